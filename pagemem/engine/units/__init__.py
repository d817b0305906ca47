"""The model's states and where they are: one ``Unit`` per paging unit (its pages by kind, its
residency, its state tier, its gradients' finality, its staleness: ``unit.py``), one
``ParamRecord`` per parameter (``records.py``), the pages (``bank.py``), the first values
(``values.py``), what is refused (``model_checks.py``, ``budget_checks.py``), which units are
on the gpu (``residency.py``, ``scopes.py``), evicted parameters (``guard.py``) and the weights
read back (``readback.py``)."""
