"""n-gram prompt lookup (vLLM's `ngram` speculative method): find the longest suffix of the context
(prompt + output so far), between prompt_lookup_min and prompt_lookup_max tokens, that occurred earlier in
it, and propose the tokens that followed that earlier occurrence.

The choice of occurrence is vLLM's: among the earlier occurrences of the longest matching n-gram, the
earliest one (overlapping the suffix is allowed). At most k tokens are proposed, fewer when the context
ends first. One pass of Knuth-Morris-Pratt over the reversed context: a prefix of the reversed context is a
suffix of the context, so every border found while scanning is an earlier occurrence of a suffix."""

from __future__ import annotations


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    total = len(tokens)
    if total < min_n or k <= 0 or max_n < 1:
        return []
    rev = tokens[::-1]
    borders = [0] * max_n     # borders[i]: the longest proper border of rev[:i + 1], for i < max_n
    best_len, best_end = 0, 0
    matched, i = 0, 1
    while i < total:
        if rev[matched] == rev[i]:
            matched += 1
            # `>=`: a later end in the reversed context is an earlier occurrence in the context
            if matched >= best_len:
                best_len, best_end = matched, i
            if i < max_n:
                borders[i] = matched
            if matched == max_n:    # never grow past max_n: continue from the longest border
                matched = borders[max_n - 1]
            i += 1
        elif matched:
            matched = borders[matched - 1]
        else:
            i += 1
    if best_len < min_n:
        return []
    start = total - 1 - best_end + best_len     # the token after the occurrence, in the context
    return tokens[start:start + k]


def propose_ngram_reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, by brute force (for the tests): longest n first, then the earliest start."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        for j in range(0, total - n):
            if tokens[j:j + n] == suffix:
                return tokens[j + n:j + n + k]
    return []
