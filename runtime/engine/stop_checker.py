"""Whether a sample ends with the token it just took, and why (vLLM's finish reasons).

Checked in this order, which decides the finish reason when several apply: a token the grammar
refuses, a stop token id, EOS, a stop string the token completes, max_tokens (where a stop
string that the final flush completes still wins), and a grammar that has reached its end.
"""

from __future__ import annotations

import logging

from kvserve.runtime.engine.request import Request
from kvserve.runtime.engine.sequence import SequenceStatus

log = logging.getLogger(__name__)


def check_stop(req: Request, token: int) -> SequenceStatus | None:
    """Called once the token is appended to the sample's sequence; feeds the detokenizer (stop
    strings are text) and sets `req.stop_reason` when a stop token or string ends the sample."""
    seq = req.seq
    status = None
    grammar = req.row.grammar
    if grammar is not None and not grammar.is_terminated and not grammar.accept(token):
        # Only reachable when every allowed token was also banned (min_tokens against a
        # finished grammar): end the sample rather than emit text the grammar refuses.
        log.warning("request %s: token %d is not allowed by its grammar; stopping", req.request_id, token)
        status = SequenceStatus.FINISHED_STOPPED
        req.detok.flush()
    elif token in req.stop_token_ids:
        status, req.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        req.detok.flush()
    elif token in req.eos_token_ids:
        status = SequenceStatus.FINISHED_STOPPED
        req.detok.flush()
    else:
        stop = req.detok.add_token(token)
        if stop is not None:
            status, req.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        elif seq.num_output_tokens >= seq.max_tokens:
            status = SequenceStatus.FINISHED_LENGTH
            if req.detok.flush() is not None:
                status, req.stop_reason = SequenceStatus.FINISHED_STOPPED, req.detok.stop_reason
    if status is None and grammar is not None and grammar.is_terminated:
        # The grammar took its stop token: nothing may follow it, even with ignore_eos.
        status = SequenceStatus.FINISHED_STOPPED
        req.detok.flush()
    return status
