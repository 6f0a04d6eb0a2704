"""specheads eval stage (see its issue)."""
