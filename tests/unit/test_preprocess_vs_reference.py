"""Pixels against an independent re-statement of the checkpoint processor (Pillow + numpy).

The oracle below is written from the reference doc (§1.3-1.5), not from our code: Image.open +
convert("RGB"), Image.resize(BICUBIC), np.pad with zeros, (x/255).astype(float32) - mean, * 1/std,
then the navit_patchify reshape/transpose. Equality is exact.
"""

import io

import numpy as np
import pytest
from PIL import Image

from backends.config import MediaConfig
from backends.errors import RequestError
from backends.preprocess import Limits, Preprocessor
from backends.preprocess.resize_rule import navit_resize
from clients.samples import encode, photo_like, text_card

MEDIA = MediaConfig()


def reference_processor(blob: bytes, media: MediaConfig = MEDIA):
    img = Image.open(io.BytesIO(blob)).convert("RGB")
    plan = navit_resize(img.width, img.height, media)
    if (plan.width, plan.height) != img.size:
        img = img.resize((plan.width, plan.height), resample=Image.Resampling.BICUBIC)
    arr = np.asarray(img)
    arr = np.pad(arr, ((0, plan.pad_height), (0, plan.pad_width), (0, 0)), mode="constant", constant_values=0)
    x = (arr / 255.0).astype(np.float32)
    x -= np.asarray(media.image_mean)
    x *= 1.0 / np.asarray(media.image_std)
    p = media.patch_size
    h, w = x.shape[:2]
    x = x[None].reshape(1, h // p, p, w // p, p, 3).transpose(0, 1, 3, 5, 2, 4).reshape(-1, 3, p, p)
    return x, [1, h // p, w // p]


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
    ref, grid = reference_processor(blob)
    assert grids.tolist() == [grid]
    assert pv.dtype.is_floating_point and pv.numpy().dtype == np.float32
    np.testing.assert_array_equal(pv.numpy(), ref)


@pytest.mark.parametrize("size", [(640, 480), (3000, 2000), (33, 1), (1, 1), (1500, 40), (224, 224)])
def test_sizes_and_padding_equal_the_reference(size):
    blob = encode(photo_like(*size, seed=size[0]), "PNG")
    pv, grids, plans = Preprocessor(MEDIA)([blob])
    ref, grid = reference_processor(blob)
    assert grids.tolist() == [grid]
    np.testing.assert_array_equal(pv.numpy(), ref)
    if plans[0].pad_width or plans[0].pad_height:
        # Padding lands on -mean/std (-1 for K2.5), never 0.
        assert pv.numpy().min() == -1.0


def test_batch_concatenates_in_prompt_order():
    blobs = [encode(photo_like(300, 200, seed=1), "JPEG"), encode(text_card(), "PNG"), encode(photo_like(50, 90), "PNG")]
    pv, grids, _ = Preprocessor(MEDIA)(blobs)
    refs = [reference_processor(b) for b in blobs]
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
    with pytest.raises(RequestError, match="max_images=2"):
        Preprocessor(MEDIA, Limits(max_images=2))([good] * 3)
    with pytest.raises(RequestError, match="max_patches=10"):
        Preprocessor(MEDIA, Limits(max_patches=10))([good])
    with pytest.raises(RequestError, match="max_image_pixels=1000"):
        Preprocessor(MEDIA, Limits(max_image_pixels=1000))([good])
