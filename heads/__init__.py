"""specheads heads stage (see its issue)."""
