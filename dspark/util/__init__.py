"""Small helpers every stage uses: argument validation and atomic file io."""
