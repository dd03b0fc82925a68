"""Step-1 losses computed without tunelab's model or loss: transformers on the same batch.

At step 1 nothing has trained yet (LoRA's B is zero, a full fine-tune has not stepped), so the
logged loss is a forward of the base checkpoint. Here the batch is rebuilt from the config
with tunelab's data pipeline (the config's dataset and the sampler's first global batch: the
same samples on any number of processes) and scored by ``transformers`` with
``torch.nn.functional.cross_entropy``, one document at a time (a packed sample is split at
its document boundaries, which is what tunelab's document mask computes).
"""

import itertools
from pathlib import Path

import torch
import torch.nn.functional as F

IGNORE = -100


def _first_indices(num_samples: int, global_batch: int, seed: int) -> list[int]:
    from tunelab.data.sampler import StatefulDistributedSampler

    sampler = StatefulDistributedSampler(
        num_samples, num_replicas=1, rank=0, shuffle=True, seed=seed
    )
    return list(itertools.islice(iter(sampler), global_batch))


def _documents(sample: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.as_tensor(sample["tokens"])
    labels = torch.as_tensor(sample["labels"])
    if "document_ids" not in sample:
        return [(tokens, labels)]
    ids = torch.as_tensor(sample["document_ids"])
    return [(tokens[ids == i], labels[ids == i]) for i in ids.unique_consecutive()]


def _hf_model(checkpoint_dir: str | Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _sum_logprobs(model, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """Sum of ``-log p(label)`` over scored positions (labels aligned with tokens), count."""
    with torch.no_grad():
        logits = model(tokens[None]).logits[0].double()
    targets = labels[1:]
    loss = F.cross_entropy(logits[:-1], targets, ignore_index=IGNORE, reduction="sum")
    return float(loss), int((targets != IGNORE).sum())


def sft_step_one_loss(config: str, *overrides: str, global_batch: int) -> float:
    """The mean token loss of the run's first global batch under the base checkpoint.

    Args:
        config: The run's config (``tiny/lora``).
        overrides: The run's overrides that shape the data or the model (others are ignored).
        global_batch: Samples per optimizer step over all processes.
    """
    from tunelab.config import instantiate, load_config

    cfg = load_config(config, overrides)
    dataset = instantiate(cfg.dataset, instantiate(cfg.tokenizer))
    model = _hf_model(cfg.model.path)
    total, count = 0.0, 0
    for index in _first_indices(len(dataset), global_batch, cfg.seed):
        for tokens, labels in _documents(dataset[index]):
            loss, scored = _sum_logprobs(model, tokens, labels)
            total, count = total + loss, count + scored
    return total / count


def dpo_step_one_logps(config: str, *overrides: str, global_batch: int) -> tuple[float, float]:
    """Mean summed completion log-probs of the chosen and rejected rows of the first pairs.

    At step 1 the policy is the base checkpoint: these are the run's ``logps/chosen`` and
    ``logps/rejected`` (its loss is ln 2 for any model, since policy and reference agree).

    Args:
        config: The run's config (``tiny/lora_dpo``).
        overrides: The run's overrides that shape the data or the model.
        global_batch: Pairs per optimizer step over all processes.
    """
    from tunelab.config import instantiate, load_config

    cfg = load_config(config, overrides)
    dataset = instantiate(cfg.dataset, instantiate(cfg.tokenizer))
    model = _hf_model(cfg.model.path)
    sums = {"chosen": 0.0, "rejected": 0.0}
    indices = _first_indices(len(dataset), global_batch, cfg.seed)
    for index in indices:
        pair = dataset[index]
        for side in sums:
            tokens = torch.as_tensor(pair[f"{side}_tokens"])
            labels = torch.as_tensor(pair[f"{side}_labels"])
            loss, _ = _sum_logprobs(model, tokens, labels)
            sums[side] -= loss
    return sums["chosen"] / len(indices), sums["rejected"] / len(indices)


def moe_step_one_router_loss(config: str, *overrides: str, global_batch: int) -> float:
    """transformers' load-balancing loss (``aux_loss``) of the run's first batch, on 1 process.

    The batch is the first ``global_batch`` samples (unpacked), right-padded as
    ``padded_collate_sft`` pads them, with the attention mask of their own tokens: one
    micro-batch, as a 1-process run of ``batch_size=global_batch`` forwards it.
    """
    from tunelab.config import instantiate, load_config

    cfg = load_config(config, overrides)
    tokenizer = instantiate(cfg.tokenizer)
    dataset = instantiate(cfg.dataset, tokenizer)
    rows = [dataset[i]["tokens"] for i in _first_indices(len(dataset), global_batch, cfg.seed)]
    length = max(map(len, rows))
    tokens = torch.full((len(rows), length), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for row, ids in enumerate(rows):
        tokens[row, : len(ids)] = torch.as_tensor(ids)
        mask[row, : len(ids)] = 1
    with torch.no_grad():
        outputs = _hf_model(cfg.model.path)(tokens, attention_mask=mask, output_router_logits=True)
    return float(outputs.aux_loss)
