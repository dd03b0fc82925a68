"""``tunelab download``: a Hugging Face hub snapshot of the weights (safetensors only)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tunelab.errors import TunelabError, first_line

# Weights as safetensors only (never pickled *.bin / *.pth), the configs and the tokenizer.
ALLOW_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.model", "generation_config.json"]


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the ``download`` subcommand."""
    parser = subparsers.add_parser(
        "download",
        parents=[parent],
        help="download a model from the Hugging Face hub (safetensors, config, tokenizer)",
        description="Download the safetensors weights, the config and the tokenizer files of a "
        "Hugging Face hub model into a folder (never pickled *.bin or *.pth weights).",
    )
    parser.add_argument("repo_id", metavar="REPO_ID", help="e.g. meta-llama/Llama-3.2-1B")
    parser.add_argument("--output-dir", required=True, type=Path, help="folder to download to")
    parser.add_argument("--token", help="Hugging Face token (default: HF_TOKEN or the login)")
    parser.add_argument("--revision", help="branch, tag or commit (default: main)")


def run(namespace: argparse.Namespace) -> int:
    """Download the snapshot.

    Args:
        namespace: The parsed arguments: ``repo_id``, ``output_dir``, ``token``, ``revision``.

    Returns:
        The exit code, 0.

    Raises:
        TunelabError: If the hub cannot be reached, the repository or revision does not exist
            or is gated, or it holds no safetensors weights.
    """
    import huggingface_hub
    from huggingface_hub import errors

    repo = namespace.repo_id
    try:
        path = huggingface_hub.snapshot_download(
            repo,
            revision=namespace.revision,
            local_dir=namespace.output_dir,
            token=namespace.token,
            allow_patterns=ALLOW_PATTERNS,
        )
    except errors.GatedRepoError as err:
        raise TunelabError(
            f"{repo} is gated: accept its license on huggingface.co and pass --token"
        ) from err
    except errors.RepositoryNotFoundError as err:
        raise TunelabError(
            f"repository {repo} not found on the Hugging Face hub (a private one needs --token)"
        ) from err
    except errors.RevisionNotFoundError as err:
        raise TunelabError(f"{repo} has no revision '{namespace.revision}'") from err
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as err:
        # Before HfHubHTTPError: huggingface_hub < 1.0 derives LocalEntryNotFoundError from it.
        raise _unreachable(repo, err) from err
    except errors.HfHubHTTPError as err:
        raise TunelabError(f"download of {repo} failed: {first_line(err)}") from err
    except OSError as err:
        # DNS, refused connections, timeouts; after HfHubHTTPError (an OSError before hub 1.0).
        raise _unreachable(repo, err) from err
    if not any(Path(path).rglob("*.safetensors")):
        raise TunelabError(
            f"{repo} has no safetensors weights; tunelab does not load pickled *.bin files"
        )
    print(f"Downloaded {repo} to {path}")
    return 0


def _unreachable(repo: str, err: BaseException) -> TunelabError:
    import huggingface_hub

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        reason = "offline mode is on (HF_HUB_OFFLINE=1) and there is no local copy"
    else:
        reason = first_line(err) or type(err).__name__
    return TunelabError(f"cannot reach the Hugging Face hub to download {repo}: {reason}")
