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
        missing = [n for n in tf_api.__all__
                   if n not in keras_api.__all__ or getattr(keras_api, n) is not getattr(tf_api, n)]
        assert not missing, missing
        assert keras_api.elastic is tf_api.elastic
        assert keras_api.callbacks is sys.modules["dualframe.tensorflow.callbacks"]
        for name in keras_api.__all__:
            getattr(keras_api, name)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().endswith("ok"), result.stderr[-3000:]
