"""``SwapEMAWeights``: evaluate and predict with the moving average of the parameters.

>>> SwapEMAWeights(swap_on_epoch=True).swap_on_epoch
True
"""

from __future__ import annotations

from trainkit.callbacks.base import Callback, Logs
from trainkit.core import optimizers


class SwapEMAWeights(Callback):
    """Swaps the parameters with their exponential moving average for evaluation and
    prediction (Keras 3's callback). The average lives in the optimizer state: build the
    optimizer with ``tk.optimizers.with_ema(optax.adam(1e-3), momentum=0.99)`` (Keras's
    ``use_ema=True``). With ``swap_on_epoch=True`` the average is also in place between
    ``on_epoch_end`` and the next ``on_epoch_begin`` (so ``ModelCheckpoint`` saves it), and
    after the last epoch the parameters stay the average."""

    def __init__(self, swap_on_epoch: bool = False):
        self.swap_on_epoch = swap_on_epoch
        self._ema_weights_in_model = False

    def _swap(self) -> None:
        trainer = self.model
        state = trainer.session.require_state()
        ema = optimizers.ema_params(state.opt_state)
        if ema is None:
            raise ValueError(
                "SwapEMAWeights needs a moving average of the parameters in the optimizer state: pass "
                "optimizer=tk.optimizers.with_ema(optax.adam(1e-3)) (Keras's use_ema=True)."
            )
        trainer.update_state(params=ema, opt_state=optimizers.replace_ema(state.opt_state, state.params))

    def _finalize(self) -> None:
        """The average follows the (swapped-in) parameters: the model keeps the EMA weights."""
        state = self.session.require_state()
        self.model.update_state(opt_state=optimizers.replace_ema(state.opt_state, state.params))

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if optimizers.ema_params(self.session.require_state().opt_state) is None:
            self._swap()  # raises the explanation before the first step
        self._ema_weights_in_model = False

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        if self.swap_on_epoch and self._ema_weights_in_model:
            self._swap()
            self._ema_weights_in_model = False

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.swap_on_epoch and not self._ema_weights_in_model:
            self._swap()
            self._ema_weights_in_model = True
            if epoch == (self.params or {}).get("epochs", 0) - 1:
                self._finalize()

    def on_test_begin(self, logs: Logs | None = None) -> None:
        if not self._ema_weights_in_model:
            self._swap()
            self._ema_weights_in_model = True

    def on_test_end(self, logs: Logs | None = None) -> None:
        if self._ema_weights_in_model:
            self._swap()
            self._ema_weights_in_model = False

    on_predict_begin = on_test_begin
    on_predict_end = on_test_end
