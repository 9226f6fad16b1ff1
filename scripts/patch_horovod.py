"""Patch an unpacked Horovod 0.28.1 sdist so it builds against torch >= 2.1 and TensorFlow >= 2.16."""
import pathlib
import re
import sys


def patch(src: pathlib.Path) -> None:
    """Raise the C++ standard to 17 and leave the XLA op source out of the TensorFlow build."""
    for rel in ("CMakeLists.txt", "horovod/torch/CMakeLists.txt"):
        path = src / rel
        text = path.read_text()
        new = re.sub(r"set\(CMAKE_CXX_STANDARD 14\)", "set(CMAKE_CXX_STANDARD 17)", text)
        if new == text and "CMAKE_CXX_STANDARD 17" not in text:
            raise SystemExit(f"patch_horovod: no C++14 setting found in {path}")
        path.write_text(new)
    tf_cmake = src / "horovod/tensorflow/CMakeLists.txt"
    text = tf_cmake.read_text()
    xla_line = 'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")'
    if xla_line in text:
        tf_cmake.write_text(text.replace(xla_line, "# xla_mpi_ops.cc left out: it does not build on TF >= 2.16"))
    elif "xla_mpi_ops.cc left out" not in text:
        raise SystemExit(f"patch_horovod: the XLA source line was not found in {tf_cmake}")


if __name__ == "__main__":
    patch(pathlib.Path(sys.argv[1]))
