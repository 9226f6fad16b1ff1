"""dualframe.reliability.failure in one process: nested watchdog guards, and how TensorFlow's op errors are described."""
import threading

from dualframe.reliability.failure import Watchdog, describe, is_lost_peer, is_peer_failure


class UnknownError(Exception):
    """Stands for tensorflow.errors.UnknownError: only the type's name and the message matter here."""


class HorovodInternalError(RuntimeError):
    """Stands for horovod.common.exceptions.HorovodInternalError: only the type's name and the message matter."""


def test_a_nested_guard_gives_the_outer_deadline_back():
    watchdog = Watchdog(timeout=60)
    me = threading.get_ident()
    with watchdog.guard("a Keras train step"):
        outer = watchdog.active()[me]
        with watchdog.guard("a Horovod collective (broadcast)"):
            assert watchdog.active()[me][1] == "a Horovod collective (broadcast)"
        assert watchdog.active()[me] == outer
    assert watchdog.active() == {}
    assert watchdog.expired(now=outer[0] + 1) is None  # nothing armed, nothing expires


def test_an_expired_guard_names_what_waited():
    watchdog = Watchdog(timeout=60)
    watchdog.arm("a Keras train step")
    deadline = watchdog.active()[threading.get_ident()][0]
    assert watchdog.expired(now=deadline - 1) is None
    assert watchdog.expired(now=deadline + 1) == "a Keras train step"
    watchdog.disarm()


def test_tensorflow_op_errors_are_described_without_the_function_node_prefix():
    prefix = "{{function_node __wrapped__HorovodAllreduce_device_/job:localhost/replica:0/task:0/device:CPU:0}} "
    shut = UnknownError(prefix + "Horovod has been shut down. This was caused by an exception on one of the ranks")
    assert is_peer_failure(shut)
    assert describe(shut).startswith("stopped: Horovod shut down because another rank failed or left")
    mismatch = UnknownError(prefix + "Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [5]")
    assert not is_peer_failure(mismatch)
    assert describe(mismatch) == ("failed: UnknownError: Mismatched ALLREDUCE tensor shapes: "
                                  "One rank sent a tensor of shape [5]")


def test_a_connection_reset_under_a_collective_is_a_lost_peer():
    # What a survivor's synchronize raised when its peer was SIGKILLed before Horovod's shutdown reached it.
    reset = HorovodInternalError("[/tmp/horovod-0.28.1/third_party/gloo/gloo/transport/tcp/pair.cc:589] "
                                 "Read error [10.203.7.2]:42922: Connection reset by peer")
    assert is_peer_failure(reset) and is_lost_peer(reset)
    assert describe(reset) == ("stopped: a connection to another rank broke [HorovodInternalError: "
                               "Read error [10.203.7.2]:42922: Connection reset by peer]")
    mismatch = HorovodInternalError("Mismatched allreduce tensor shapes: One rank sent a tensor of shape [5]")
    assert not is_lost_peer(mismatch)
    assert describe(mismatch).startswith("failed: HorovodInternalError: Mismatched allreduce")
    assert not is_lost_peer(ValueError("Connection reset by peer"))  # only Horovod's and TensorFlow's op errors
