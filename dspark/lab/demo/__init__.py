"""`dspark demo`: its configuration, the run, the report and the plots."""
