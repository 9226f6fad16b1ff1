#!/usr/bin/env bash
# Horovod's own test_torch.py against Horovod and dualframe, only the import changed (scripts/horovod_suite.sh).
#
#   bash scripts/horovod_torch_suite.sh /tmp/horovod-v0.28.1
#   LAUNCHERS=horovodrun TARGETS=dualframe bash scripts/horovod_torch_suite.sh DIR
export FILES=${FILES:-test_torch.py}
exec bash "$(dirname "$0")/horovod_suite.sh" "$@"
