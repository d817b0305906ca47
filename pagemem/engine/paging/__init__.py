"""How units reach the gpu in each iteration: traced warm-up, the plan, or on demand
(``pager.py``); the plan compiled to actions (``executor.py``); the gpu arena's size
(``arena.py``); the measured peak (``peaks.py``); autograd's saved parameters (``saved.py``);
the executor's host time, measured (``measure.py``)."""
