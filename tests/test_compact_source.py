"""The CUDA text handed to MLX: `_launch.compact` (without comments, indentation or blank
lines) and `_launch.prune` (without the header items a kernel never reaches)."""

import pytest

from mlx_qsa.kernels._launch import common_header, compact, kernel_sections, prune, top_level_items


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


_HEADER = (
    "#include <cuda_bf16.h>\n"
    "namespace qsa {\n"
    "constexpr int FULL = 32;\n"
    "struct Box {\n"
    "int w;\n"
    "};\n"
    "__device__ int lone(int a) { return a; }\n"
    "template <int N, typename T = Box>\n"
    "__device__ int twice(int a) { return helper(a) * N; }\n"
    "__device__ int helper(int a) { return a + FULL; }\n"
    "__device__ float helper(float a) { return a; }\n"
    '__device__ void talk() { asm volatile("{ .reg .pred p; }" ::: "memory"); }\n'
    "#define USES(x) lone(x)\n"
    "}  \n"
)


def test_top_level_items_split_losslessly_and_name_what_they_define() -> None:
    items = top_level_items(_HEADER)
    assert "".join(text for text, _ in items) == _HEADER
    assert [name for _, name in items] == [
        None, None, "FULL", "Box", "lone", "twice", "helper", "helper", "talk", None, None,
    ]  # fmt: skip
    # the literal's braces and semicolon stay inside `talk`
    assert [t for t, n in items if n == "talk"][0].count(";") == 2
    for text in (common_header(), *kernel_sections("selector.cu").values()):
        assert "".join(t for t, _ in top_level_items(text)) == text


def test_prune_keeps_what_the_source_reaches() -> None:
    out = prune(_HEADER, "int y = qsa::twice<2>(x);")
    # twice -> helper (both overloads) -> FULL; twice's default argument names Box; the
    # directives, the namespace and what a macro names (lone) stay; talk goes.
    assert "twice" in out and out.count("helper(") == 3 and "FULL = 32" in out
    assert "struct Box" in out and "lone" in out and "#include" in out
    assert "talk" not in out
    assert out.startswith("#include <cuda_bf16.h>\nnamespace qsa {\n")
    assert out.endswith("}  \n")
    assert prune(_HEADER, "int y = 0;") == prune(_HEADER, "")
    assert "helper" not in prune(_HEADER, "")


def test_prune_puts_each_item_on_its_own_lines() -> None:
    # A dropped item may have held the newline before a directive: kept items end lines.
    header = "int a() { return 1; }int b() { return 2; }\n#define C a()\nint d;"
    out = prune(header, "C + d")
    assert out == "int a() { return 1; }\n#define C a()\nint d;\n"
