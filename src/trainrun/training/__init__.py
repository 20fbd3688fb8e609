"""One run's orchestration: set-up, the loop, the hooks that act at call boundaries, the
summary. (Not ``run/``: ``trainrun.run`` is the public function.)"""
