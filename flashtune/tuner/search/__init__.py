"""The search side of the tuner: which config to measure next, and which one wins.

``encoding`` presents configs to Optuna's samplers, ``study`` owns the studies (names,
storage, samplers), ``proposers`` asks a study (or walks the candidates) for proposals,
``lock`` keeps two workers from accepting the same one, ``prediction`` orders and prunes
proposals by the cost model's predictions, ``selection`` re-measures the finalists and
picks the winner.
"""
