"""Block-map codes: what a block of the (query, key) grid holds. The lowest module of masks: the
masks, the block lists torch's ``BlockMask`` is made of and the plans all read them."""

#: Block-map codes: no pair of the block may attend / some may / all may.
EMPTY, PARTIAL, FULL = 0, 1, 2
