"""Speculative decoding: the configuration, the draft proposers and the acceptance rules.

The scheduler gives a decoding request with k draft tokens 1 + k query tokens; the engine
verifies the drafts against the target's own samples at those positions (``acceptance``),
rolls back the rejected positions and proposes the next drafts (``ngram`` here; a draft model
in ``engine/draft_model.py``).
"""
