"""What ``dualframe plan`` measures on a TensorFlow/Keras 3 model."""
