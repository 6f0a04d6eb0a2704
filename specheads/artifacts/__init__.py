"""What training and evaluation leave: a trained head with its training facts, its classification metrics, eval's metrics.json."""
