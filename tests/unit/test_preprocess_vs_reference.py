"""Pixels against an independent re-statement of the checkpoint processor (Pillow + numpy).

The oracle (oracles/checkpoint_processor.py) is written from docs/kimi_k25.md, not from our code: Image.open +
convert("RGB"), Image.resize(BICUBIC), np.pad with zeros, (x/255).astype(float32) - mean, * 1/std,
then the navit_patchify reshape/transpose. Equality is exact.
"""

import io
import re

import numpy as np
import pytest
import torch
from PIL import Image

from backends.config import Limits, MediaConfig
from backends.errors import RequestError
from backends.preprocess import Preprocessor
from clients.samples import encode, photo_like, text_card
from oracles.checkpoint_processor import navit_size, reference_pixels

MEDIA = MediaConfig()


def _modes():
    rgb = Image.fromarray(photo_like(97, 61, seed=3))
    yield "RGB-png", encode(rgb, "PNG")
    yield "RGB-jpeg-420", encode(rgb, "JPEG", quality=85)
    yield "RGBA", encode(rgb.convert("RGBA"), "PNG")
    yield "L", encode(rgb.convert("L"), "PNG")
    yield "LA", encode(rgb.convert("LA"), "PNG")
    yield "P", encode(rgb.convert("P"), "PNG")
    yield "1", encode(rgb.convert("1"), "PNG")
    yield "CMYK-jpeg", encode(rgb.convert("CMYK"), "JPEG")
    yield "I;16-png", encode(Image.fromarray(photo_like(97, 61)[..., 0].astype(np.uint16) * 257), "PNG")
    yield "GIF", encode(rgb.convert("P"), "GIF")
    yield "BMP", encode(rgb, "BMP")
    yield "TIFF", encode(rgb, "TIFF")
    yield "WEBP", encode(rgb, "WEBP", quality=80)


@pytest.mark.parametrize("name,blob", list(_modes()), ids=[n for n, _ in _modes()])
def test_every_mode_equals_the_reference(name, blob):
    pv, grids, _ = Preprocessor(MEDIA)([blob])
    ref, grid = reference_pixels(blob)
    assert grids.tolist() == [grid]
    assert pv.dtype.is_floating_point and pv.numpy().dtype == np.float32
    np.testing.assert_array_equal(pv.numpy(), ref)


@pytest.mark.parametrize("size", [(640, 480), (3000, 2000), (33, 1), (1, 1), (1500, 40), (224, 224)])
def test_sizes_and_padding_equal_the_reference(size):
    blob = encode(photo_like(*size, seed=size[0]), "PNG")
    pv, grids, plans = Preprocessor(MEDIA)([blob])
    ref, grid = reference_pixels(blob)
    assert grids.tolist() == [grid]
    np.testing.assert_array_equal(pv.numpy(), ref)
    if plans[0].plan.pad_width or plans[0].plan.pad_height:
        # Padding lands on -mean/std (-1 for K2.5), never 0.
        assert pv.numpy().min() == -1.0


def test_batch_concatenates_in_prompt_order():
    blobs = [encode(photo_like(300, 200, seed=1), "JPEG"), encode(text_card(), "PNG"), encode(photo_like(50, 90), "PNG")]
    pv, grids, _ = Preprocessor(MEDIA)(blobs)
    refs = [reference_pixels(b) for b in blobs]
    np.testing.assert_array_equal(pv.numpy(), np.concatenate([r for r, _ in refs]))
    assert grids.tolist() == [g for _, g in refs]


def test_exif_orientation_is_not_applied():
    img = Image.fromarray(photo_like(64, 32))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW on display
    blob = encode(img, "JPEG", exif=exif)
    _, grids, _ = Preprocessor(MEDIA)([blob])
    assert grids.tolist() == [[1, 4, 6]]  # 64 wide stays 64 wide (padded to 84 -> 6 patches)


@pytest.mark.parametrize("blob,needle", [
    (b"definitely not an image", "image 0: not a decodable image"),
    (b"", "image 0: empty"),
    (encode(photo_like(64, 64), "PNG")[:60], "image 0:"),
])
def test_bad_bytes_are_request_errors_naming_the_image(blob, needle):
    with pytest.raises(RequestError, match=needle):
        Preprocessor(MEDIA)([blob])


def test_limits_are_enforced_with_their_names():
    good = encode(photo_like(64, 64), "PNG")
    # Each error names the limit and the request's own value.
    with pytest.raises(RequestError, match="3 images in one request exceeds the limit max_images=2"):
        Preprocessor(MEDIA, Limits(max_images=2))([good] * 3)
    with pytest.raises(RequestError, match="need 36 patches, exceeding the limit max_patches=10"):
        Preprocessor(MEDIA, Limits(max_patches=10))([good])
    with pytest.raises(RequestError, match=r"64x64 = 4096 pixels exceeds the limit max_image_pixels=1000"):
        Preprocessor(MEDIA, Limits(max_image_pixels=1000))([good])  # refused by Pillow's guard from the header
    with pytest.raises(RequestError, match=r"64x64 = 4096 pixels exceeds the limit max_image_pixels=4000"):
        Preprocessor(MEDIA, Limits(max_image_pixels=4000))([good])  # under Pillow's warning threshold x2: ours


def reference_video_chunk(blobs, media: MediaConfig = MEDIA):
    """Reference chunk processing (docs/kimi_k25.md#video-chunks): plan from the first frame with the per-frame patch
    limit, resize every frame to that size, pad, normalize, patchify t-major."""
    frames = [Image.open(io.BytesIO(b)).convert("RGB") for b in blobs]
    new_w, new_h, pad_w, pad_h = navit_size(frames[0].width, frames[0].height, media,
                                            patch_limit=media.in_patch_limit_each_frame)
    arrs = []
    for img in frames:
        if img.size != (new_w, new_h):
            img = img.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
        arrs.append(np.pad(np.asarray(img), ((0, pad_h), (0, pad_w), (0, 0))))
    x = (np.stack(arrs) / 255.0).astype(np.float32)
    x -= np.asarray(media.image_mean)
    x *= 1.0 / np.asarray(media.image_std)
    t, h, w, _ = x.shape
    p = media.patch_size
    x = x.reshape(t, h // p, p, w // p, p, 3).transpose(0, 1, 3, 5, 2, 4).reshape(-1, 3, p, p)
    return x, [t, h // p, w // p]


def test_video_chunk_and_image_in_one_request_equal_the_reference():
    # 1200x900 frames: the per-frame limit (4096 patches) shrinks them, where an image would not be.
    frames = [encode(photo_like(1200, 900, seed=s), "JPEG") for s in range(3)]
    still = encode(photo_like(1200, 900, seed=9), "PNG")
    pv, grids, plans = Preprocessor(MEDIA)(frames + [still], media_frames=[3, 0])
    chunk, chunk_grid = reference_video_chunk(frames)
    image, image_grid = reference_pixels(still)
    assert grids.tolist() == [chunk_grid, image_grid]
    # per-frame limit 4096 (floor-divided counts): 1200x900 -> 1041x780, padded to a 56x76 grid;
    # as a still image it keeps 1200x900 -> 66x86.
    assert chunk_grid == [3, 56, 76] and image_grid == [1, 66, 86]
    np.testing.assert_array_equal(pv.numpy(), np.concatenate([chunk, image]))
    assert [m.is_video for m in plans] == [True, False]


def test_one_frame_chunk_uses_the_per_frame_limit():
    blob = encode(photo_like(1200, 900), "PNG")
    _, grids, _ = Preprocessor(MEDIA)([blob], media_frames=[1])
    assert grids.tolist() == [reference_video_chunk([blob])[1]]


@pytest.mark.parametrize("frames,needle", [([2], "describes 2 IMAGES entries but 1"), ([5], "0 (image) or 1..4"),
                                           ([-1], "0 (image) or 1..4")])
def test_bad_media_frames_are_request_errors(frames, needle):
    with pytest.raises(RequestError, match=re.escape(needle)):
        Preprocessor(MEDIA)([encode(photo_like(30, 30), "PNG")], media_frames=frames)


def test_torch_resize_path_equals_the_pillow_path():
    # The GPU path (decode -> upload -> our exact bicubic) run on CPU: same bits as Pillow's.
    blobs = [encode(photo_like(3000, 2000, seed=4), "JPEG"), encode(text_card(), "PNG"),
             encode(photo_like(1200, 900, seed=5), "PNG"), encode(photo_like(1200, 900, seed=6), "PNG")]
    a, ga, _ = Preprocessor(MEDIA)(blobs, media_frames=[0, 0, 2])
    b, gb, _ = Preprocessor(MEDIA, resize="torch")(blobs, media_frames=[0, 0, 2])
    assert ga.tolist() == gb.tolist()
    assert torch.equal(a, b)


def test_a_frame_that_fails_to_decode_among_parallel_decodes_names_itself():
    # Decoding runs on threads ahead of the upload: the error must still be the failing frame's own,
    # and the shared decode pool must serve the next request normally.
    good = [encode(photo_like(120, 90, seed=s), "JPEG") for s in range(4)]
    full = encode(photo_like(640, 480, seed=9), "JPEG")
    cut = full[: len(full) // 2]  # header intact (the plan reads it), body truncated
    with pytest.raises(RequestError, match=r"image 2: decoding failed"):
        Preprocessor(MEDIA)(good[:2] + [cut] + good[2:])
    pv, grids, _ = Preprocessor(MEDIA)(good)
    refs = [reference_pixels(b) for b in good]
    np.testing.assert_array_equal(pv.numpy(), np.concatenate([r for r, _ in refs]))


def test_preprocessing_stops_between_media_once_cancelled():
    from backends.errors import RequestCancelled

    blobs = [encode(photo_like(64, 48, seed=s), "PNG") for s in range(3)]
    asked = []

    def cancelled():
        asked.append(1)
        return len(asked) > 1  # the client gives up after the first media

    with pytest.raises(RequestCancelled, match="after 1 of 3 media"):
        Preprocessor(MEDIA)(blobs, cancelled=cancelled)


def test_cancellation_is_asked_at_most_once_per_interval():
    from backends.serving.steps import throttled

    now = [0.0]
    asked = []
    check = throttled(lambda: asked.append(now[0]) or True, 0.02, clock=lambda: now[0])
    results = []
    for t in (0.0, 0.01, 0.019, 0.021, 0.03, 0.05):
        now[0] = t
        results.append(check())
    assert results == [False, False, False, True, False, True]
    assert asked == [0.021, 0.05]


def test_runs_of_back_to_back_frames_are_patchified_together_with_the_same_result(monkeypatch):
    """On a GPU a run of same-sized JPEGs comes back as views of one tensor and is patchified in one
    launch. Here the frames are made to come back that way on the CPU: the pixel values must equal
    the frame-by-frame result, across run boundaries (another size, a video chunk)."""
    sizes = [(448, 448)] * 3 + [(300, 200)] + [(448, 448)] * 2
    blobs = [encode(photo_like(w, h, seed=i), "PNG") for i, (w, h) in enumerate(sizes)]
    blobs += [encode(photo_like(448, 448, seed=20 + i), "PNG") for i in range(2)]  # a 2-frame chunk
    blobs += [encode(photo_like(448, 448, seed=30 + i), "PNG") for i in range(2)]
    frames = [0, 0, 0, 0, 0, 0, 2, 0, 0]
    pre = Preprocessor(MediaConfig())
    want, want_grid, _ = pre(blobs, media_frames=frames)

    plain_frames = Preprocessor._frames

    def back_to_back(self, *args):
        decoded = list(plain_frames(self, *args))
        joined = torch.cat([f.reshape(-1) for f in decoded])  # one tensor, the frames one after another
        offset = 0
        for f in decoded:
            yield joined[offset: offset + f.numel()].view(f.shape)
            offset += f.numel()

    monkeypatch.setattr(Preprocessor, "_frames", back_to_back)
    calls = []
    plain_patchify = Preprocessor._patchify
    monkeypatch.setattr(Preprocessor, "_patchify", lambda self, px, plan: calls.append(tuple(px.shape)) or plain_patchify(self, px, plan))
    got, grid, _ = pre(blobs, media_frames=frames)
    assert grid.tolist() == want_grid.tolist() and torch.equal(got, want)
    assert [c[0] if len(c) == 4 else 1 for c in calls] == [3, 1, 2, 2, 2]  # runs, the chunk, a run
