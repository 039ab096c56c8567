"""The round loop: the run's parts (`build`), its state (`RunState`), resuming it, pacing
hosts of unequal speed, and a host joining a live job."""
