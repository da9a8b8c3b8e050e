"""How torchfix changes torch: source patches and per-thread globals (``patches``, on the text edits of ``source``),
per-thread slot patches (``slots``), torch's C++ thread-local stash (``stash``), counted process switches
(``switches``), default changes (``defaults``, ``config``) and the cache of what patching computes (``cache``).

Nothing here names a fix: the fixes (``torchfix.fixes``) are made of these parts.
"""
