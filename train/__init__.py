"""specheads train stage (see its issue)."""
