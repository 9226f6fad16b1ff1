"""A TensorFlow/Keras 3 model captured as the core's ``Graph`` and what each of its nodes costs and reads."""
