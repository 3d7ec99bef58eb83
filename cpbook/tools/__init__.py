"""Layer 10, maintenance commands for the book (not used by the chapters)."""
