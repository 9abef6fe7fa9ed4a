"""When to speculate and how far: the break-even controller (``controller``), the batch's
(``batch_control``) and the draft length ``num_draft="auto"`` chooses (``length``). Pure
policy over measured costs and acceptance: nothing here imports the engine (``decode``), which
asks it."""
