"""The Triton kernels on a request's path compile once per process, whatever the image: nothing an
image's size decides (sizes, pitches, offsets, the address of a plane or frame inside a batch buffer) is
one of their specialization keys. Triton specializes integers on divisibility by 16 and on being 1, and
pointers on 16-byte alignment, unless a kernel says otherwise; each such variant costs a compile (about
200 ms on an H100) on the request that first meets it. tests/gpu/test_gpu_kernels.py counts the compiled
variants on the GPU; this file holds the declarations, which the CPU can read."""

import pytest

triton = pytest.importorskip("triton")


def params(kernel) -> dict:
    return {p.name: p for p in kernel.params}


def test_the_colour_kernel_ignores_sizes_pitches_and_plane_addresses():
    from backends.kernels import jpeg_color

    p = params(jpeg_color._ycc_rgb_kernel)
    for name in ("H", "W", "DH", "DW", "Y_PITCH", "C_PITCH", "Y_IMAGE", "C_IMAGE"):
        assert p[name].do_not_specialize, name
    for name in ("y_ptr", "cb_ptr", "cr_ptr"):  # planes back to back: an odd width moves Cb and Cr
        assert p[name].do_not_specialize_on_alignment, name


def test_the_patchify_kernel_ignores_sizes_and_the_frames_address():
    from backends.kernels import patchify

    p = params(patchify._patchify_kernel)
    for name in ("H", "W", "GH", "GW"):
        assert p[name].do_not_specialize, name
    assert p["img_ptr"].do_not_specialize_on_alignment


def test_the_encoder_kernels_take_no_size_argument_they_specialize_on():
    """RoPE's token count is not specialized on; the add + LayerNorm kernel takes no size but its width
    (a model constant); their tensors are whole allocations or views at model-fixed offsets."""
    from backends.kernels import add_norm, rope

    assert params(rope._rope_inplace_kernel)["n_tokens"].do_not_specialize
    ints = [n for n, q in params(add_norm._add_layernorm_kernel).items() if not q.is_constexpr and not n.endswith("_ptr")]
    assert ints == ["eps"]
