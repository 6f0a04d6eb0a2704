"""`specheads demo`: gen → train (SpecDec++ head and SPRINTER verifier) → eval both → export both, on the embedded pair."""
