"""Maintenance commands for the book (not used by the chapters)."""
