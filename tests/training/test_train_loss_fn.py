"""The training loop and evaluate with the caller's loss function: a next-token language
model trained and evaluated by the image classifier's loop, its loss averaged over tokens
and its metrics global; its checkpoints; the default loss function's channels_last."""

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset

from mgpu_helpers import launch
from mgpu_helpers.training.train import (
    BatchLoss,
    Metrics,
    classification_loss,
    evaluate,
    load_checkpoint,
    save_checkpoint,
    train_one_epoch,
)

VOCAB, LENGTH = 12, 9
IGNORE = -100  # padding after a sequence's end: predicted from, never predicted


def token_data(n=40, seed=0):
    """Sequences of 2 to ``LENGTH`` tokens from a fixed rule (each token's successor is
    fixed), padded with ``IGNORE``: batches hold different numbers of tokens."""
    generator = torch.Generator().manual_seed(seed)
    successor = torch.randperm(VOCAB, generator=generator)
    tokens = torch.full((n, LENGTH), IGNORE)
    tokens[:, 0] = torch.randint(VOCAB, (n,), generator=generator)
    for position in range(1, LENGTH):
        tokens[:, position] = successor[tokens[:, position - 1]]
    lengths = torch.randint(2, LENGTH + 1, (n,), generator=generator)
    tokens[torch.arange(LENGTH) >= lengths[:, None]] = IGNORE
    return TensorDataset(tokens)


def bigram_model(seed=0, tied=False):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB, bias=False))
    if tied:  # the output layer reuses the embedding, as GPT-2 does
        model[1].weight = model[0].weight
    return model


def next_token_loss(model, batch, device):
    """Each token predicts the next; the mean is over the predicted tokens."""
    (tokens,) = batch
    tokens = tokens.to(device)
    inputs, targets = tokens[:, :-1].clamp(min=0), tokens[:, 1:]  # padding reads as token 0
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    return BatchLoss(loss, (targets != IGNORE).sum(),
                     (logits.detach().argmax(-1) == targets).sum(),  # never equal to IGNORE
                     unit="tokens")


def predicted_tokens(dataset):
    return int((dataset.tensors[0][:, 1:] != IGNORE).sum())


def test_the_loop_trains_a_next_token_model_and_counts_tokens():
    data = token_data()
    model = bigram_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    loader = DataLoader(data, batch_size=8, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    first = train_one_epoch(model, loader, optimizer, device="cpu", progress=False,
                            accumulate=2, loss_fn=next_token_loss)
    for _ in range(10):
        last = train_one_epoch(model, loader, optimizer, device="cpu", progress=False,
                               accumulate=2, loss_fn=next_token_loss)
    tokens = predicted_tokens(data)
    assert tokens != len(data) * (LENGTH - 1)  # padded: the count tells tokens apart
    assert first.items == last.items == tokens and last.unit == "tokens"
    assert str(last).endswith(f"over {tokens} tokens")
    assert last.loss < first.loss / 4 and last.accuracy > 0.95


def test_the_loss_is_the_mean_over_all_tokens_not_over_batches():
    data, model = token_data(), bigram_model()
    metrics = evaluate(model, data, batch_size=7, device="cpu", loss_fn=next_token_loss)
    tokens = data.tensors[0]
    with torch.no_grad():
        logits = model(tokens[:, :-1].clamp(min=0))
        per_token = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(),
                                    ignore_index=IGNORE)
        per_batch = [next_token_loss(model, (tokens[i:i + 7],), "cpu").loss
                     for i in range(0, len(tokens), 7)]
    assert metrics.items == predicted_tokens(data)
    assert metrics.loss == pytest.approx(per_token.item(), rel=1e-6)
    assert metrics.loss != pytest.approx(torch.stack(per_batch).mean().item(), rel=1e-4)


def train_tokens_on_uneven_shards():
    data = token_data(17)
    shard = Subset(data, range(10) if dist.get_rank() == 0 else range(10, 17))
    model = DDP(bigram_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return train_one_epoch(model, DataLoader(shard, batch_size=3), optimizer, progress=False,
                           accumulate=2, loss_fn=next_token_loss)


def evaluate_tokens(dataset):
    return evaluate(bigram_model(), dataset, batch_size=4, loss_fn=next_token_loss)


@pytest.mark.usefixtures("no_leftover_processes")
def test_token_metrics_are_global_on_every_rank():
    trained = launch(train_tokens_on_uneven_shards, nprocs=2, backend="gloo", return_all=True)
    assert trained[0] == trained[1]
    assert trained[0].items == predicted_tokens(token_data(17))

    data = token_data(11)
    alone = evaluate(bigram_model(), data, batch_size=4, device="cpu", loss_fn=next_token_loss)
    together = launch(evaluate_tokens, data, nprocs=2, backend="gloo", return_all=True)
    assert together[0] == together[1]
    assert together[0].items == alone.items == predicted_tokens(data)
    assert together[0].accuracy == alone.accuracy
    assert together[0].loss == pytest.approx(alone.loss, rel=1e-6)


def train_tokens(model, optimizer, epochs):
    for _ in range(epochs):
        train_one_epoch(model, DataLoader(token_data(), batch_size=8), optimizer,
                        device="cpu", progress=False, loss_fn=next_token_loss)


def test_checkpoints_resume_a_language_model_with_tied_weights_exactly(tmp_path):
    straight = bigram_model(tied=True)
    optimizer = torch.optim.Adam(straight.parameters(), lr=0.05)
    train_tokens(straight, optimizer, 2)

    half = bigram_model(tied=True)
    optimizer = torch.optim.Adam(half.parameters(), lr=0.05)
    train_tokens(half, optimizer, 1)
    save_checkpoint(tmp_path / "lm.pt", half, optimizer, epoch=1)
    resumed = bigram_model(seed=1, tied=True)
    optimizer = torch.optim.Adam(resumed.parameters(), lr=0.05)
    assert load_checkpoint(tmp_path / "lm.pt", resumed, optimizer)["epoch"] == 1
    assert resumed[1].weight is resumed[0].weight  # still one tensor, not two copies
    train_tokens(resumed, optimizer, 1)
    for key, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_token_metrics_print_their_unit_and_classification_keeps_samples():
    assert str(Metrics(0.5, 0.25, 96, "tokens")) == "loss 0.5000, accuracy 25.00% over 96 tokens"
    assert Metrics(0.5, 0.25, 96).samples == 96


def test_the_default_loss_can_move_images_to_channels_last():
    seen = []

    class Recorder(nn.Module):
        def forward(self, images):
            seen.append(images.is_contiguous(memory_format=torch.channels_last))
            return images.flatten(1)[:, :3]

    batch = (torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 0]))
    plain = classification_loss(Recorder(), batch, torch.device("cpu"))
    nhwc = partial(classification_loss, channels_last=True)(Recorder(), batch,
                                                             torch.device("cpu"))
    assert seen == [False, True]
    assert plain.items == nhwc.items == 4 and torch.equal(plain.loss, nhwc.loss)
