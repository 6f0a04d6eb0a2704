"""`specheads demo`: gen → train (SpecDec++ head and SPRINTER verifier) → eval both → export both, on the embedded pair;
then the prompt-lookup pair in wall clock (nothing to train) beside them."""
