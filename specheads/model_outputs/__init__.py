"""What a model's forward gives: the hidden state a head reads, logits and training-free signals, the sampling transform and draws."""
