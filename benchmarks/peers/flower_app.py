"""The Flower app that ``flower_secaggplus.py`` runs: logistic regression on the demo's hospitals.

Runs inside Flower's own processes (the ServerApp under the SuperLink, the ClientApp under each
SuperNode), with the Flower virtualenv's python; it imports nothing of privreg. The model is
privreg's horizontal LR model: 30 standardised features and a bias, 31 numbers, one gradient
step per round (learning rate 0.5, L2 0.001, as ``horizontal_rounds`` runs privreg), the
clients' new models averaged by the server through Flower's SecAgg+ workflow and mod.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
from flwr.app import Context
from flwr.client import NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import ndarrays_to_parameters
from flwr.server import Grid, LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.serverapp import ServerApp

HOSPITALS = ("hospital_a", "hospital_b", "hospital_c")
FEATURES = 30
LEARNING_RATE, L2 = 0.5, 0.001


def hospital_rows(folder: Path, index: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Hospital ``index`` of ``count``: the demo's own three files, or its 569 rows dealt
    round-robin to ``count`` hospitals (as privreg's benchmark deals them)."""
    frames = [pd.read_csv(folder / f"{name}.csv") for name in HOSPITALS]
    if count == len(HOSPITALS):
        frame = frames[index]
    else:
        frame = pd.concat(frames, ignore_index=True).iloc[index::count]
    X = frame.drop(columns=["patient_id", "diagnosis"]).to_numpy(dtype=float)
    return np.hstack([X, np.ones((len(X), 1))]), frame["diagnosis"].to_numpy(dtype=float)


class Hospital(NumPyClient):
    """One gradient step of L2-regularised logistic regression on the hospital's rows."""

    def __init__(self, X: np.ndarray, y: np.ndarray) -> None:
        self.X, self.y = X, y

    def fit(self, parameters, config):
        (weights,) = parameters
        p = 1.0 / (1.0 + np.exp(-self.X @ weights))
        grad = self.X.T @ (p - self.y) / len(self.y) + L2 * weights
        return [weights - LEARNING_RATE * grad], len(self.y), {}


def client_fn(context: Context):
    config = context.node_config
    X, y = hospital_rows(
        Path(str(config["data-dir"])), int(config["partition-id"]), int(config["num-partitions"])
    )
    return Hospital(X, y).to_client()


client = ClientApp(client_fn=client_fn, mods=[secaggplus_mod])
server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    """Run the rounds and write when each ended (the strategy's central evaluation is called
    once before the first round and after every round) to the run config's ``out`` file."""
    config = context.run_config
    clients, rounds = int(config["clients"]), int(config["rounds"])
    ends: list[float] = []
    model: list[np.ndarray] = []

    def stamp(server_round, parameters, _config):
        ends.append(time.time())
        model[:] = parameters
        return None

    strategy = FedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=clients,
        min_available_clients=clients,
        initial_parameters=ndarrays_to_parameters([np.zeros(FEATURES + 1)]),
        evaluate_fn=stamp,
    )
    legacy = LegacyContext(context, config=ServerConfig(num_rounds=rounds), strategy=strategy)
    if config["secure"]:
        fit = SecAggPlusWorkflow(
            num_shares=float(config["num-shares"]),
            reconstruction_threshold=int(config["threshold"]),
        )
        DefaultWorkflow(fit_workflow=fit)(grid, legacy)
    else:
        DefaultWorkflow()(grid, legacy)
    result = {"ends": ends, "model": [float(v) for v in model[0]] if model else []}
    Path(str(config["out"])).write_text(json.dumps(result))
