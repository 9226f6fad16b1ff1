#!/usr/bin/env bash
# Horovod's own TensorFlow and Keras test files against Horovod and dualframe (scripts/horovod_suite.sh, FILES preset).
#
#   bash scripts/horovod_tf_suite.sh /tmp/horovod-v0.28.1
#   TARGETS="horovod dualframe dualframe+" FILES=test_tensorflow2_keras.py bash scripts/horovod_tf_suite.sh DIR
#
# The Keras files that apply to Keras 3: the TF2 Keras ones (test_tensorflow_keras.py and test_keras.py are
# written for Keras 2's graph-mode sessions and standalone keras).
export FILES=${FILES:-test_tensorflow.py test_tensorflow_process_sets.py test_tensorflow2_keras.py test_tensorflow2_keras_process_sets.py}
exec bash "$(dirname "$0")/horovod_suite.sh" "$@"
