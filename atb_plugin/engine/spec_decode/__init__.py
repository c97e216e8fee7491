"""Speculative decoding (docs/speculative.md): a proposer drafts tokens in the engine core, the
scheduler schedules them after each decode request's last token, the runner verifies them in one
forward with the exact rejection sampler, and the scheduler keeps what was accepted."""
