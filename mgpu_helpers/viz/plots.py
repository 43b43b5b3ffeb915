"""Plots and widgets the chapters use: image grids, augmentation draws, an explorer, a
pipeline's Gantt chart."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from ..parallel.pipeline import Event, bubble_fraction


def _as_displayable(image):
    if isinstance(image, Image.Image):
        return image
    tensor = image.detach().cpu()
    if tensor.dtype == torch.uint8:
        tensor = tensor.float() / 255
    return tensor.clamp(0, 1).permute(1, 2, 0).numpy()


def show_images(images: Sequence, titles: Sequence[str] | None = None, ncols: int = 8,
                size: float = 1.6, suptitle: str | None = None):
    """Draw PIL images or CHW tensors (values in [0, 1] or uint8) in a grid; returns the figure."""
    if not images:
        raise ValueError("show_images needs at least one image")
    ncols = min(ncols, len(images))
    nrows = -(-len(images) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(size * ncols, size * nrows + 0.3),
                             squeeze=False)
    for slot, ax in enumerate(axes.flat):
        ax.axis("off")
        if slot < len(images):
            ax.imshow(_as_displayable(images[slot]), interpolation="nearest")
            if titles is not None:
                ax.set_title(titles[slot], fontsize=9)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    return fig


def augmentation_grid(image, transform: Callable, draws: int = 7, seed: int = 0,
                      title: str | None = None):
    """The original image beside ``draws`` augmented versions, reproducible from ``seed``."""
    torch.manual_seed(seed)
    augmented = [transform(image) for _ in range(draws)]
    return show_images([image, *augmented], ["original"] + [f"draw {i + 1}" for i in
                                                            range(draws)],
                       ncols=draws + 1, suptitle=title)


def explorer_transform(rotation: float, brightness: float, contrast: float,
                       saturation: float, flip: bool, crop_scale: float) -> v2.Compose:
    """The deterministic transform the explorer shows for one setting of its sliders."""
    steps: list = [
        v2.Lambda(lambda img: TF.rotate(img, rotation)),
        v2.Lambda(lambda img: TF.adjust_brightness(img, brightness)),
        v2.Lambda(lambda img: TF.adjust_contrast(img, contrast)),
        v2.Lambda(lambda img: TF.adjust_saturation(img, saturation)),
    ]
    if flip:
        steps.append(v2.Lambda(TF.horizontal_flip))
    if crop_scale < 1:
        steps.append(v2.Lambda(lambda img: _centre_crop_fraction(img, crop_scale)))
    return v2.Compose(steps)


def _centre_crop_fraction(image, scale: float):
    width, height = TF.get_size(image)[::-1]
    keep = scale ** 0.5  # scale is a fraction of the area, as in RandomResizedCrop
    cropped = TF.center_crop(image, [max(1, round(height * keep)), max(1, round(width * keep))])
    return TF.resize(cropped, [height, width])


EXPLORER_PRESETS = {
    "rotation -30": {"rotation": -30},
    "rotation +30": {"rotation": 30},
    "brightness 0.5": {"brightness": 0.5},
    "contrast 1.8": {"contrast": 1.8},
    "saturation 0": {"saturation": 0},
    "flip": {"flip": True},
    "crop scale 0.4": {"crop_scale": 0.4},
}
_NEUTRAL = {"rotation": 0.0, "brightness": 1.0, "contrast": 1.0, "saturation": 1.0,
            "flip": False, "crop_scale": 1.0}


def explorer_presets(image):
    """A static grid of what each slider does at one setting, drawn under the explorer so
    that a page without a widget front end (a script, nbconvert, GitHub) still shows it."""
    images = [image] + [explorer_transform(**{**_NEUTRAL, **preset})(image)
                        for preset in EXPLORER_PRESETS.values()]
    return show_images(images, ["original", *EXPLORER_PRESETS], ncols=len(images), size=1.8)


def augmentation_explorer(image):
    """Sliders for rotation, brightness, contrast, saturation, flip and crop scale that
    redraw ``image`` live, above a static grid of presets (see :func:`explorer_presets`)."""
    import ipywidgets as widgets
    from IPython.display import display

    controls = {
        "rotation": widgets.FloatSlider(0, min=-180, max=180, step=5, description="rotation"),
        "brightness": widgets.FloatSlider(1, min=0.2, max=2, step=0.1, description="brightness"),
        "contrast": widgets.FloatSlider(1, min=0.2, max=2, step=0.1, description="contrast"),
        "saturation": widgets.FloatSlider(1, min=0, max=2, step=0.1, description="saturation"),
        "flip": widgets.Checkbox(False, description="flip"),
        "crop_scale": widgets.FloatSlider(1, min=0.2, max=1, step=0.05, description="crop scale"),
    }

    def draw(**settings):
        transformed = explorer_transform(**settings)(image)
        fig = show_images([image, transformed], ["original", "transformed"], size=3)
        plt.show()
        return fig

    panel = widgets.interactive(draw, **controls)
    display(panel)
    explorer_presets(image)
    plt.show()
    return panel


def sampler_partitions(orders: dict[int, list[list[int]]], dataset_size: int, title: str = ""):
    """Which rank reads each sample, epoch by epoch, and in what order.

    Args:
        orders: ``orders[epoch][rank]`` is the list of indices that rank drew that epoch.
        dataset_size: number of samples; padded duplicates are marked with a black dot.

    Each row is an epoch, each column a position in the epoch's global order (rank 0's
    share, then rank 1's...); a cell's colour is the rank and its number the sample index.
    """
    epochs = sorted(orders)
    ranks = len(orders[epochs[0]])
    per_rank = len(orders[epochs[0]][0])
    fig, ax = plt.subplots(figsize=(min(0.32 * per_rank * ranks + 1.5, 16), 0.5 * len(epochs) + 1))
    colours = plt.get_cmap("tab10")
    for row, epoch in enumerate(epochs):
        seen: set[int] = set()
        for rank, indices in enumerate(orders[epoch]):
            for slot, index in enumerate(indices):
                column = rank * per_rank + slot
                ax.add_patch(plt.Rectangle((column, row), 1, 1, color=colours(rank), alpha=0.6))
                ax.text(column + 0.5, row + 0.5, str(index), ha="center", va="center",
                        fontsize=6)
                if index in seen:
                    ax.plot(column + 0.85, row + 0.2, "k.", markersize=5)
                seen.add(index)
    ax.set(xlim=(0, per_rank * ranks), ylim=(len(epochs), 0),
           yticks=[r + 0.5 for r in range(len(epochs))],
           yticklabels=[f"epoch {e}" for e in epochs], xticks=[])
    ax.set_title(title, pad=18)
    for rank in range(ranks):
        ax.text((rank + 0.5) * per_rank, -0.1, f"rank {rank}", ha="center", va="bottom",
                color=colours(rank))
    ax.set_xlabel(f"{dataset_size} samples; black dot: a padded duplicate")
    fig.tight_layout()
    return fig


def plot_timeline(events: Sequence[Event], ax=None, title: str | None = None):
    """Gantt chart of a pipeline step: one row per rank (``Event.rank``), forward and
    backward boxes labelled by micro-batch; gaps are the bubble. Where ranks hold several
    virtual stages, each virtual stage gets its own shade (darker: earlier in the model)
    and the rows are labelled by rank; with one stage module per rank, by stage."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.7 * len({e.rank for e in events}) + 1.2))
    origin = min(e.start for e in events)
    pieces = sorted({e.virtual_stage for e in events if e.virtual_stage is not None})
    if pieces:
        shades = [0.9 - 0.5 * i / max(1, len(pieces) - 1) for i in range(len(pieces))]
        maps = {"forward": plt.get_cmap("Blues"), "backward": plt.get_cmap("Oranges")}
        colours = {(kind, piece): maps[kind](shade) for kind in maps
                   for piece, shade in zip(pieces, shades, strict=True)}
        handles = [Patch(color=colours[kind, piece], label=f"{kind[0].upper()} stage {piece}")
                   for kind in maps for piece in pieces]
    else:
        colours = {"forward": "#2a7ab0", "backward": "#e3863b"}
        handles = [Patch(color=colour, label=kind) for kind, colour in colours.items()]
    for e in events:
        start, width = (e.start - origin) * 1e3, (e.end - e.start) * 1e3
        colour = colours[e.kind, e.virtual_stage] if pieces else colours[e.kind]
        ax.broken_barh([(start, width)], (e.rank - 0.4, 0.8), color=colour,
                       edgecolor="white")
        dark = not pieces or shades[pieces.index(e.virtual_stage)] > 0.6
        ax.text(start + width / 2, e.rank, str(e.micro_batch), ha="center", va="center",
                color="white" if dark else "black", fontsize=7)
    ranks = sorted({e.rank for e in events})
    ax.set_yticks(ranks, [f"{'rank' if pieces else 'stage'} {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=7,
              ncols=2 if pieces else 1, frameon=False)
    ax.set_title(title or f"bubble {bubble_fraction(events):.0%} of the time")
    return ax
