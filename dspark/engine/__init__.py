"""A minimal reference speculative-decoding engine that exercises dspark end to end."""
