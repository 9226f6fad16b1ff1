"""What ``dualframe plan`` measures on a torch model."""
