"""The TF adapter's layering: dualframe.tensorflow stands alone, the Keras API re-exports all of it."""
import subprocess
import sys
import textwrap


def test_tensorflow_imports_without_keras_and_keras_re_exports_every_name():
    code = textwrap.dedent("""
        import sys
        import dualframe.tensorflow as tf_api
        assert "dualframe.tensorflow.keras" not in sys.modules, "dualframe.tensorflow imported its keras package"
        import dualframe.keras
        import dualframe.tensorflow.keras as keras_api
        assert dualframe.keras is keras_api
        # As in Horovod, the Keras module has its own optimizer wrapper and value collectives.
        own = {"DistributedOptimizer", "allreduce", "allgather", "broadcast", "reducescatter"}
        missing = [n for n in tf_api.__all__ if n not in keras_api.__all__
                   or (n not in own and getattr(keras_api, n) is not getattr(tf_api, n))]
        assert not missing, missing
        assert all(getattr(keras_api, n) is not getattr(tf_api, n) for n in own)
        assert keras_api.elastic is tf_api.elastic
        assert keras_api.callbacks is sys.modules["dualframe.tensorflow.dp.callbacks"]
        for name in keras_api.__all__:
            getattr(keras_api, name)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_an_optimizer_saved_from_the_old_module_path_still_loads():
    # .keras files written before the move name the module dualframe.tensorflow.keras.optimizer; Keras finds
    # the class by its registered name (dualframe>DistributedOptimizer), so they load as they are.
    import keras

    import dualframe.tensorflow.keras as hvd

    hvd.init()
    config = keras.saving.serialize_keras_object(
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvd.Compression.fp16, backward_passes_per_step=2))
    assert config["registered_name"] == "dualframe>DistributedOptimizer"
    config["module"] = "dualframe.tensorflow.keras.optimizer"
    loaded = keras.saving.deserialize_keras_object(config)
    assert isinstance(loaded, hvd.DistributedOptimizer) and loaded.reduction.compression is hvd.Compression.fp16
    assert loaded.accumulation.steps == 2 and abs(float(loaded.learning_rate) - 0.1) < 1e-7
