"""`_launch.compact`: the CUDA text handed to MLX, without comments, indentation or blank lines."""

import pytest

from mlx_qsa.kernels._launch import common_header, compact, kernel_sections


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
    header = common_header()
    for text in [header, *kernel_sections("selector.cu").values()]:
        lines = text.split("\n")
        assert lines[-1] == ""
        assert all(ln == ln.strip() and ln for ln in lines[:-1])
        assert not any(ln.startswith("//") for ln in lines)
    # the fused selector's `#ifdef QSA_FUSED` blocks survive with their #endif
    score = kernel_sections("selector.cu")["score"]
    assert score.count("#ifdef") + score.count("#ifndef") + score.count("#if ") == score.count(
        "#endif"
    )
