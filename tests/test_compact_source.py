"""The CUDA text handed to MLX: kernel bodies through `_launch.compact` (without comments,
indentation or blank lines), shared device code as an `#include` line (`_launch.include`)."""

import pytest

from mlx_qsa.kernels import _launch
from mlx_qsa.kernels._launch import compact, include, included_text, kernel_sections


def test_comments_and_indentation_go_literals_stay() -> None:
    src = (
        '  const char* a = "x // not a comment";  // a comment\n'
        "\n"
        "    int b = 6 / 3; /* inline */ int c = '/';\n"
        "/* two\n lines */ int d = 1;\n"
        '#define S(x) "\\"//" x   // macro comment\n'
        'asm volatile("mov.u32 %0, %1;\\n" : "=r"(e) : "r"(f));\n'
    )
    assert compact(src) == (
        'const char* a = "x // not a comment";\n'
        "int b = 6 / 3;   int c = '/';\n"
        "int d = 1;\n"
        '#define S(x) "\\"//" x\n'
        'asm volatile("mov.u32 %0, %1;\\n" : "=r"(e) : "r"(f));\n'
    )


def test_unterminated_block_comment_is_an_error() -> None:
    with pytest.raises(ValueError, match="unterminated"):
        compact("int a; /* never closed\n")


def test_sources_handed_to_mlx_keep_their_directives_and_lose_their_comments() -> None:
    for text in kernel_sections("selector.cu").values():
        lines = text.split("\n")
        assert lines[-1] == ""
        assert all(ln == ln.strip() and ln for ln in lines[:-1])
        assert not any(ln.startswith("//") for ln in lines)
    # the fused selector's `#ifdef QSA_FUSED` blocks survive with their #endif
    score = kernel_sections("selector.cu")["score"]
    assert score.count("#ifdef") + score.count("#ifndef") + score.count("#if ") == score.count(
        "#endif"
    )


def test_include_names_the_file_beside_the_launchers_and_its_text_is_read_back() -> None:
    line = include("common.cuh")
    path = _launch._DIR / "common.cuh"
    assert line == f'#include "{path}"\n' and path.is_absolute()
    assert included_text("#define A 1\n" + line) == path.read_text()
    assert included_text("#define A 1\n") == ""


def test_include_refuses_a_path_an_include_line_cannot_hold(monkeypatch) -> None:
    from pathlib import Path

    monkeypatch.setattr(_launch, "_DIR", Path('/tmp/a"b'))
    with pytest.raises(RuntimeError, match="cannot name this path"):
        include("common.cuh")


def test_constants_declare_template_values_as_mlx_would() -> None:
    import mlx.core as mx

    from mlx_qsa.kernels._launch import constants

    values = (("D", 256), ("ON", True), ("OFF", False), ("T", mx.bfloat16), ("F", mx.float32))
    got = constants(values)
    assert got == (
        "constexpr int D = 256;\n"
        "constexpr bool ON = true;\n"
        "constexpr bool OFF = false;\n"
        "using T = __nv_bfloat16;\n"
        "using F = float;\n"
    )
    assert constants(()) == ""
    with pytest.raises(ValueError, match=r"template value X=2.5: expected int, bool or a dtype"):
        constants((("X", 2.5),))
    with pytest.raises(ValueError, match="template value C="):
        constants((("C", mx.complex64),))


def test_include_refuses_a_file_that_is_not_there(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(_launch, "_DIR", tmp_path)
    with pytest.raises(RuntimeError, match="not a file"):
        include("common.cuh")
    (tmp_path / "common.cuh").write_text("// here\n")
    assert include("common.cuh") == f'#include "{tmp_path / "common.cuh"}"\n'
