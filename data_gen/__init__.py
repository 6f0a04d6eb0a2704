"""data_gen: label token mixes with acceptance probabilities from a draft/target pair."""
