"""When a request stops on its own tokens: its length (the model's, ``max_tokens``), EOS, or a
stop token id, after ``min_tokens``. Pure. (Stop strings are the front end's: they need text.)"""

from __future__ import annotations

from dsv4_serving.engine.request import Request, RequestStatus


def append_tokens(
    req: Request, tokens: list[int], max_model_len: int
) -> tuple[list[int], RequestStatus | None]:
    """Append a step's tokens to ``req`` up to the first that stops it: the tokens kept and
    the stop. Tokens none of which can stop it (no length reached, no eos or stop token among
    them: the common case, k + 1 tokens with MTP) go in at once."""
    sp, m = req.sampling_params, len(tokens)
    if (
        req.num_tokens + m < max_model_len
        and req.num_output_tokens + m < sp.max_tokens
        and (sp.ignore_eos or req.eos_token_id not in tokens)
        and not (sp.stop_token_ids and any(t in sp.stop_token_ids for t in tokens))
    ):
        req.all_token_ids.extend(tokens)
        return list(tokens), None
    new: list[int] = []
    for t in tokens:
        req.all_token_ids.append(t)
        new.append(t)
        status = check_stop(req, t, max_model_len)
        if status is not None:
            return new, status
    return new, None


def check_stop(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """Whether ``token``, just appended, stops ``req``."""
    sp = req.sampling_params
    n_out = req.num_output_tokens
    if req.num_tokens >= max_model_len or n_out >= sp.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if n_out < sp.min_tokens:
        return None
    if not sp.ignore_eos and token == req.eos_token_id:
        return RequestStatus.FINISHED_STOPPED
    if token in sp.stop_token_ids:
        req.stop_token_id = token
        return RequestStatus.FINISHED_STOPPED
    return None
