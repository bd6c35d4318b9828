"""What a prefill and a decode engine must agree on for KV to be interchangeable, carried in
``kv_transfer_params`` (``params_extra`` of the export) and checked on the decode side before
anything is pulled. Pure Python: the HTTP front end runs it on every decode request.

Ring lengths include the MTP lookahead (``num_speculative_tokens``), paged rows per block
follow ``block_size``: a mismatch would make the imported state mean something else, so it is
refused, never "fixed up". The prompt hash guards against a decode request whose prompt is not
the one the prefill computed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dsv4_kvtransfer.integrity import Fingerprint, ParallelLayout, cache_group_digests

PREFIX = "dsv4_"


class KVIncompatible(ValueError):
    """The two engines' KV layouts differ (a deployment error, never the client's)."""


class KVPromptMismatch(ValueError):
    """The decode request's prompt is not the one the prefill engine computed."""


@dataclass(frozen=True, slots=True)
class KVCompat:
    """This engine's side of the agreement."""

    architecture: str
    block_size: int
    num_speculative_tokens: int
    kv_dtype: str
    revision: str = ""
    """The weights' (``--revision``); only in the fingerprint, which the pull checks."""

    def fingerprint(
        self, rows: Iterable[tuple[str, str, str, tuple[int, ...]]], parallel: ParallelLayout
    ) -> Fingerprint:
        """This engine's KV layout as exports carry it and pulls check it
        (``dsv4_kvtransfer.integrity``): these fields, the cache tensors' ``(name, group,
        dtype, row shape)`` and the slice of the KV this engine exports."""
        return Fingerprint(
            self.architecture,
            self.kv_dtype,
            self.block_size,
            cache_group_digests(rows),
            parallel,
            self.revision,
        )

    def params_extra(self, prompt_token_ids: Sequence[int]) -> dict[str, Any]:
        return {
            f"{PREFIX}architecture": self.architecture,
            f"{PREFIX}block_size": self.block_size,
            f"{PREFIX}num_speculative_tokens": self.num_speculative_tokens,
            f"{PREFIX}kv_dtype": self.kv_dtype,
            f"{PREFIX}num_prompt_tokens": len(prompt_token_ids),
            f"{PREFIX}prompt_hash": prompt_hash(prompt_token_ids),
        }

    def check(self, params: Mapping[str, Any], prompt_token_ids: Sequence[int]) -> None:
        """Raise ``KVIncompatible`` / ``KVPromptMismatch``; fields a peer did not send (another
        engine's params) are not checked here (the import still checks every buffer's shape)."""
        mine = self.params_extra(prompt_token_ids)
        for key, what in (
            ("architecture", "architecture"),
            ("block_size", "block_size"),
            ("num_speculative_tokens", "num_speculative_tokens (MTP ring lookahead)"),
            ("kv_dtype", "KV dtype"),
        ):
            theirs = params.get(PREFIX + key)
            if theirs is not None and theirs != mine[PREFIX + key]:
                raise KVIncompatible(
                    f"the prefill engine's {what} is {theirs!r}, this decode engine's is "
                    f"{mine[PREFIX + key]!r}: prefill and decode must run the same model with "
                    "the same --block-size, --num-speculative-tokens and --dtype"
                )
        n = params.get(PREFIX + "num_prompt_tokens")
        h = params.get(PREFIX + "prompt_hash")
        if (n is not None and n != len(prompt_token_ids)) or (
            h is not None and h != mine[PREFIX + "prompt_hash"]
        ):
            raise KVPromptMismatch(
                f"kv_transfer_params were computed for another prompt ({n} tokens) than this "
                f"request's ({len(prompt_token_ids)} tokens)"
            )


def prompt_hash(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()[:32]
