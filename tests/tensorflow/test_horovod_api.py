"""Horovod's TF and Keras API in dualframe: every public name, its signature, types and exceptions (size 1)."""
import importlib.util
import inspect
import pathlib
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow as hvd_tf
import dualframe.tensorflow.keras as hvd
from dualframe.errors import StrategyError

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("horovod_api", ROOT / "scripts" / "horovod_api.py")
horovod_api = sys.modules["horovod_api"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(horovod_api)

hvd.init()


@pytest.fixture(scope="module")
def rows():
    return horovod_api.rows()


def test_every_horovod_name_is_there_with_horovods_signature(rows):
    assert len(rows) > 100  # the four modules were read
    bad = [(r.module, r.name, r.status) for r in rows
           if r.status not in ("Horovod's own", "same signature", "present")]
    assert not bad, bad
    # "present" only where Horovod's is a class and dualframe's a namespace of the same two compressors.
    assert {r.name for r in rows if r.status == "present"} == {"Compression"}
    assert hvd.Compression.none is not None and hvd.Compression.fp16 is not None


def test_the_docs_table_is_the_codes(rows):
    page = ROOT / "docs" / "horovod_api.md"
    assert page.read_text() == horovod_api.table(rows), \
        "docs/horovod_api.md is out of date: python scripts/horovod_api.py --write docs/horovod_api.md"


def test_reading_horovods_source_gives_what_importing_it_gives():
    # The fallback for modules that fail to import on Keras 3 must read the same signatures.
    objects, imported = horovod_api.horovod_names("horovod.tensorflow.keras")
    source = horovod_api.source_names(horovod_api._horovod_root() / "tensorflow" / "keras" / "__init__.py")
    defined = [n for n, obj in objects.items() if getattr(obj, "__module__", "") == "horovod.tensorflow.keras"]
    assert {"DistributedOptimizer", "allreduce", "load_model", "reducescatter"} <= set(defined)
    for name in defined:
        assert source[name] == imported[name], name


def test_the_rule_refuses_what_horovod_scripts_would_trip_on():
    hv = [("tensor", "POSITIONAL_OR_KEYWORD", ""), ("name", "POSITIONAL_OR_KEYWORD", "None")]
    assert horovod_api.compare(hv, hv + [("extra", "KEYWORD_ONLY", "1")]) == ("same signature", "extra")
    assert horovod_api.compare(hv, hv[::-1])[0].startswith("different: parameter 1 is name=None")
    assert horovod_api.compare(hv, hv + [("extra", "POSITIONAL_OR_KEYWORD", "1")])[0].startswith(
        "different: additions not keyword-only")
    assert horovod_api.compare(hv, [hv[0], ("name", "POSITIONAL_OR_KEYWORD", "'x'")])[0].startswith("different")


def test_gradient_tape_methods_keep_horovods_order():
    import horovod.tensorflow as horovod

    theirs = type(horovod.DistributedGradientTape(tf.GradientTape()))
    for method in ("gradient",):
        want = list(inspect.signature(getattr(theirs, method)).parameters)
        got = list(inspect.signature(getattr(hvd.DistributedGradientTape, method)).parameters)
        assert got[:len(want)] == want, (method, got, want)
    x = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(x * x)
    grads = hvd.DistributedGradientTape(tape, groups=1).gradient(loss, [x], None, True)  # use_generic_names
    np.testing.assert_allclose(grads[0].numpy(), [2.0, 4.0])


def test_before_init_rank_raises_a_value_error_and_init_takes_horovods_order():
    code = textwrap.dedent("""
        import dualframe.tensorflow as hvd
        try:
            hvd.rank()
        except ValueError as error:
            assert isinstance(error, RuntimeError), "no longer the RuntimeError dualframe raised"
        else:
            raise AssertionError("rank() before init() did not raise")
        hvd.init([0])          # Horovod's init(comm, process_sets): a rank list as comm
        assert hvd.size() == 1 and hvd.rank() == 0
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_horovods_positional_calls():
    assert hvd_tf.broadcast_object({"a": 1}, 0, None, "obj") == {"a": 1}
    assert hvd_tf.allgather_object(3, None, "three") == [3]
    np.testing.assert_allclose(hvd_tf.allreduce(tf.ones(2), None, "", "", hvd.Compression.none, hvd.Sum).numpy(), 1.0)
    np.testing.assert_allclose(hvd_tf.broadcast(tf.ones(2), 0, "b", True).numpy(), 1.0)  # ignore_name_scope
    v = tf.Variable([3.0])
    assert hvd_tf.broadcast_variables([v], 0, hvd_tf.global_process_set, True) is None and v.numpy()[0] == 3.0
    # The Keras module's value collectives: (value, name, ...) as Horovod's Keras API.
    np.testing.assert_allclose(hvd.allreduce(np.float32(2.5), "two_and_a_half").numpy(), 2.5)
    np.testing.assert_allclose(hvd.allgather(np.ones((1, 2)), "g").numpy(), np.ones((1, 2)))
    np.testing.assert_allclose(hvd.broadcast(np.arange(3.0), 0, "arange").numpy(), np.arange(3.0))
    np.testing.assert_allclose(hvd.reducescatter(np.arange(4.0), "rs", hvd.Sum).numpy(), np.arange(4.0))


def _data():
    rng = np.random.RandomState(0)
    x = rng.randn(32, 4).astype("float32")
    return x, (x @ np.arange(4.0).reshape(4, 1)).astype("float32")


def _fit(optimizer, epochs=2, callbacks=(), validation=False):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks),
              validation_data=(x, y) if validation else None)
    return model


@pytest.mark.parametrize("wrap", [hvd.DistributedOptimizer, hvd_tf.DistributedOptimizer])
def test_the_wrapped_optimizer_is_an_instance_of_the_users_class_and_trains_the_same(wrap):
    opt = wrap(keras.optimizers.Adam(0.05, beta_1=0.8))
    assert isinstance(opt, keras.optimizers.Adam) and isinstance(opt, hvd.DistributedOptimizer)
    assert opt.beta_1 == 0.8 and type(opt).__name__ == "DistributedOptimizer"
    again = wrap(opt.inner_optimizer)  # the same optimizer twice, as Horovod allows
    assert type(again) is type(opt) and again.inner_optimizer is opt.inner_optimizer
    trained, plain = _fit(opt), _fit(keras.optimizers.Adam(0.05, beta_1=0.8))
    for a, b in zip(trained.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert len(opt.variables) == 2 + len(opt.inner_optimizer.variables)  # no slots of its own


def test_a_saved_wrapper_loads_as_an_instance_of_the_users_class(tmp_path):
    model = _fit(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5), groups=2), epochs=1)
    config = keras.saving.serialize_keras_object(model.optimizer)
    assert config["registered_name"] == "dualframe>DistributedOptimizer"
    model.save(tmp_path / "m.keras")
    loaded = hvd.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, keras.optimizers.SGD) and isinstance(loaded.optimizer, hvd.DistributedOptimizer)
    assert loaded.optimizer.momentum == 0.5
    with pytest.raises(StrategyError, match="legacy_opts=True"):
        hvd.load_model(tmp_path / "m.keras", None, None, hvd.Compression.none, True)


def test_tf_distributed_optimizer_gives_a_tf1_optimizer_horovods_wrapper():
    import horovod.tensorflow as horovod

    opt = hvd_tf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), use_locking=True)
    assert type(opt) is type(horovod.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1)))
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer or a tf.compat.v1.train.Optimizer"):
        hvd_tf.DistributedOptimizer("sgd")


def test_groups_and_local_variables_are_checked_and_kept():
    for bad in (0, "two", [[1.0], 3]):
        with pytest.raises(StrategyError, match="groups must be"):
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), groups=bad)
    with pytest.warns(DeprecationWarning, match="num_groups"):
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), num_groups=2)
    assert opt.reduction.groups == 2
    with pytest.raises(StrategyError, match="scale_local_gradients must be True or False"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), scale_local_gradients="yes")
    with pytest.raises(TypeError, match="too many positional arguments"):  # shard: keyword-only
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), None, "", "", hvd.Compression.none, False, 1.0,
                                 hvd.Average, 1, False, 0, None, hvd.global_process_set, True, "optimizer")


def test_best_model_checkpoint_keeps_the_best_epoch(tmp_path):
    path = tmp_path / "best.keras"
    best = hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=str(path))
    model = _fit(keras.optimizers.SGD(0.05), epochs=3, callbacks=[best], validation=True)
    x, y = _data()
    assert path.exists() and best.best == pytest.approx(min(best.best, float(model.evaluate(x, y, verbose=0))))
    reloaded = keras.models.load_model(path)
    assert float(reloaded.evaluate(x, y, verbose=0)) == pytest.approx(best.best, rel=1e-5)
    with pytest.raises(StrategyError, match="BestModelCheckpoint has no filepath"):
        _fit(keras.optimizers.SGD(0.05), epochs=1, callbacks=[hvd.callbacks.BestModelCheckpoint()], validation=True)
