"""The plotting helpers draw what they are given; the explorer's transform does what it says."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from torchvision.transforms.v2 import functional as TF  # noqa: E402

from mgpu_helpers.viz import plots  # noqa: E402

NEUTRAL = {"rotation": 0.0, "brightness": 1.0, "contrast": 1.0, "saturation": 1.0,
           "flip": False, "crop_scale": 1.0}


@pytest.fixture
def picture():
    pixels = torch.arange(3 * 12 * 16, dtype=torch.uint8).reshape(3, 12, 16)
    return TF.to_pil_image(pixels)


def test_neutral_settings_leave_the_image_unchanged(picture):
    out = plots.explorer_transform(**NEUTRAL)(picture)
    assert torch.equal(TF.pil_to_tensor(out), TF.pil_to_tensor(picture))


def test_flip_and_crop_do_what_they_say(picture):
    flipped = plots.explorer_transform(**{**NEUTRAL, "flip": True})(picture)
    assert torch.equal(TF.pil_to_tensor(flipped), TF.pil_to_tensor(picture).flip(-1))
    cropped = plots.explorer_transform(**{**NEUTRAL, "crop_scale": 0.25})(picture)
    assert cropped.size == picture.size
    assert not torch.equal(TF.pil_to_tensor(cropped), TF.pil_to_tensor(picture))


def test_show_images_draws_one_axis_per_image_and_titles(picture):
    fig = plots.show_images([picture, TF.pil_to_tensor(picture)], ["a", "b"], ncols=4)
    titled = [ax.get_title() for ax in fig.axes if ax.images]
    assert titled == ["a", "b"]
    plt.close(fig)


def test_show_images_needs_images():
    with pytest.raises(ValueError, match="at least one image"):
        plots.show_images([])


def test_augmentation_grid_is_reproducible(picture):
    def draw(seed):
        fig = plots.augmentation_grid(picture, lambda img: TF.rotate(
            img, float(torch.empty(1).uniform_(-90, 90))), draws=3, seed=seed)
        arrays = [ax.images[0].get_array().tolist() for ax in fig.axes if ax.images]
        plt.close(fig)
        return arrays

    assert draw(0) == draw(0)
    assert draw(0) != draw(1)


def test_presets_grid_has_original_and_every_preset():
    fig = plots.explorer_presets(Image.new("RGB", (8, 8), "red"))
    assert [ax.get_title() for ax in fig.axes] == ["original", *plots.EXPLORER_PRESETS]
    plt.close(fig)


def test_sampler_partitions_marks_each_padded_duplicate():
    orders = {0: [[4, 1, 0], [2, 3, 4]], 1: [[0, 2, 4], [1, 3, 0]]}
    fig = plots.sampler_partitions(orders, 5, "t")
    ax = fig.axes[0]
    assert len(ax.patches) == 12
    assert len(ax.lines) == 2  # one duplicate per epoch
    assert [t.get_text() for t in ax.texts][:3] == ["4", "1", "0"]
    plt.close(fig)
