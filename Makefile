# privreg: every target creates the virtualenv on first use, from the pinned lock file.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_HOME ?= $(CURDIR)/var/prefect
export PREFECT_LOGGING_LEVEL ?= INFO
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120

.PHONY: demo demo-parties test lint install clean ui deploy worker serve bench bench-psi bench-paillier bench-walr bench-vertical \
        bench-horizontal bench-labeldp bench-sparse-lda bench-vertical bench-network bench-federation bench-endpoint \
        peer-flower peer-spu peer-openmined peer-heu bench-party-jobs bench-wan bench-local-run bench-samplers peer-opendp bench-budget \
        bench-partitions

install: $(STAMP)

$(STAMP): pyproject.toml requirements.lock setup.py core/paillier/_montgomery.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=23.2"
	$(BIN)/python -m pip install --quiet -c requirements.lock -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	mkdir -p "$(PREFECT_HOME)"
	$(BIN)/python -m flows.pipeline

# The docs site (MkDocs, Material, mkdocstrings) into site/; --strict: a broken link, a missing
# anchor or an API reference to an object that moved fails the build
.PHONY: docs
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# sdist and wheel (the C kernel compiled, the demo's files as package data) into dist/;
# `pip install dist/privreg-*.whl` then gives `privreg demo` without a checkout
.PHONY: dist
dist: $(STAMP)
	$(BIN)/python -m build --outdir dist .

demo-parties: $(STAMP)
	mkdir -p "$(PREFECT_HOME)"
	$(BIN)/python demo/parties.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	mkdir -p "$(PREFECT_HOME)"
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=25

bench-psi: $(STAMP) peer-spu peer-openmined
	$(BIN)/python benchmarks/bench_psi.py --size 100000 --repeats 3
	$(BIN)/python benchmarks/bench_psi.py --size 1000000 --repeats 1
	$(BIN)/python benchmarks/bench_psi.py --size 1000000 --small 10000 --repeats 1 --no-baseline --no-ecdh

# KKRT16 at 10M x 10M: time and peak memory per party (77 buckets; long on two cores)
bench-psi-10m: $(STAMP)
	$(BIN)/python benchmarks/bench_psi.py --size 10000000 --repeats 1 --no-baseline --no-ecdh

API_URL ?= http://127.0.0.1:4200/api

ui: $(STAMP)
	mkdir -p "$(PREFECT_HOME)"
	$(BIN)/prefect server start --host 127.0.0.1 --port 4200

deploy: $(STAMP)
	PREFECT_API_URL=$(API_URL) $(BIN)/prefect work-pool create privreg-process --type process --overwrite
	PREFECT_API_URL=$(API_URL) $(BIN)/prefect deploy --all --no-prompt

worker: $(STAMP)
	PREFECT_API_URL=$(API_URL) $(BIN)/prefect worker start --pool privreg-process

serve: $(STAMP)
	PREFECT_API_URL=$(API_URL) $(BIN)/python -m flows.serve

# The training charts as the Prefect UI shows them: trains on the demo hospitals against a local
# server (UI_CHECK_URL, started if none answers) and saves Chromium screenshots under
# var/ui-check/. Needs the distribution's chromium package; not part of `make test` or CI.
.PHONY: ui-check
ui-check: $(STAMP)
	mkdir -p "$(PREFECT_HOME)"
	$(BIN)/python demo/ui_check.py

BENCH_VERTICAL_ARGS ?=
BENCH_NETWORK_ARGS ?=

# CLI start-up per command (wall and CPU, median of 5), a 3-party vertical job's end-to-end
# time against its training, the organisation's Prefect server on SQLite against PostgreSQL
# under twenty concurrent sides (needs PostgreSQL's programs, PG_BIN), then a job's failures
# across processes
bench-federation: $(STAMP)
	mkdir -p "$(PREFECT_HOME)"
	$(BIN)/python benchmarks/bench_cli.py
	$(BIN)/python benchmarks/bench_job_overhead.py
	PATH="$(PG_BIN):$$PATH" $(BIN)/python benchmarks/bench_prefect_db.py
	$(BIN)/python benchmarks/bench_federation.py

bench-network: $(STAMP)
	mkdir -p "$(PREFECT_HOME)"
	$(BIN)/python benchmarks/bench_network.py $(BENCH_NETWORK_ARGS)

bench-endpoint: $(STAMP)
	$(BIN)/python benchmarks/bench_endpoint.py

bench-vertical: $(STAMP)
	mkdir -p "$(PREFECT_HOME)"
	$(BIN)/python benchmarks/bench_vertical.py $(BENCH_VERTICAL_ARGS)

# the demo's job files locally (sides as threads) and every organisation its own process
bench-local-run: $(STAMP)
	$(BIN)/python benchmarks/bench_local_run.py

bench-party-jobs: $(STAMP)
	mkdir -p "$(PREFECT_HOME)"
	$(BIN)/python benchmarks/bench_party_jobs.py

# PSI, vertical LR, horizontal LR, WALR, label DP and sparse LDA with every organisation in its
# own network namespace, at LAN, WAN and far WAN (tbf and a delaying relay, benchmarks/wan.py),
# spu's RR22 and KKRT PSI beside privreg's in the same namespaces; needs root (~20 min); one
# protocol: BENCH_WAN_ARGS="--only walr --repeats 1"
BENCH_WAN_ARGS ?= --repeats 3 --psi-size 100000 --psi-large 1000000
bench-wan: $(STAMP) peer-spu
	mkdir -p "$(PREFECT_HOME)"
	$(BIN)/python benchmarks/bench_wan.py $(BENCH_WAN_ARGS)

# Links cut for 5 s, 60 s and past the restart grace, an endpoint restarted and every
# certificate renewed, during PSI, a vertical round and a horizontal round (its long cut with
# the job's threshold and with every hospital required), organisations in their own
# namespaces: each party's outcome, model equal to an uncut run's, messages intact; needs
# root (~16 min)
BENCH_PARTITIONS_ARGS ?=
bench-partitions: $(STAMP)
	mkdir -p "$(PREFECT_HOME)"
	$(BIN)/python benchmarks/bench_partitions.py $(BENCH_PARTITIONS_ARGS)

bench-paillier: $(STAMP)
	$(MAKE) peer-heu || echo "sf-heu unavailable: comparing with the anchor numbers"
	$(BIN)/python benchmarks/bench_paillier.py

bench-walr: $(STAMP)
	$(BIN)/python benchmarks/bench_walr.py
	$(BIN)/python benchmarks/bench_walr_protocol.py

bench-labeldp: $(STAMP)
	$(BIN)/python benchmarks/bench_labeldp.py

bench-horizontal: $(STAMP) peer-flower
	$(BIN)/python benchmarks/bench_horizontal.py

# Peers measured beside privreg in the same benchmark run, each in its own virtualenv under
# var/peers (never privreg's dependencies); benchmarks/peers/ holds their drivers.
PEERS := var/peers

peer-flower: $(PEERS)/flower/.installed
peer-spu: $(PEERS)/spu/.installed
peer-openmined: $(PEERS)/openmined/.installed
peer-opendp: $(PEERS)/opendp/.installed
peer-heu: $(PEERS)/heu/.installed

$(PEERS)/flower/.installed:
	$(PYTHON) -m venv $(PEERS)/flower
	$(PEERS)/flower/bin/python -m pip install --quiet "flwr==1.42.0" numpy pandas
	touch $@

# SecretFlow's libpsi: about 440 MB of native libraries, and jax
$(PEERS)/spu/.installed:
	$(PYTHON) -m venv $(PEERS)/spu
	$(PEERS)/spu/bin/python -m pip install --quiet "spu==0.9.5"
	touch $@

# OpenMined's PSI (ECDH over P-256), the baseline of bench-psi
$(PEERS)/openmined/.installed:
	$(PYTHON) -m venv $(PEERS)/openmined
	$(PEERS)/openmined/bin/python -m pip install --quiet "openmined-psi==2.0.6"
	touch $@

# SecretFlow HEU's C++ Paillier (ZPaillier), the peer of bench-paillier
$(PEERS)/heu/.installed:
	$(PYTHON) -m venv $(PEERS)/heu
	$(PEERS)/heu/bin/python -m pip install --quiet "sf-heu==0.5.2b0" numpy
	touch $@

# OpenDP's exact discrete Laplace and Gaussian samplers, the peer of bench-samplers
$(PEERS)/opendp/.installed:
	$(PYTHON) -m venv $(PEERS)/opendp
	$(PEERS)/opendp/bin/python -m pip install --quiet "opendp==0.16.0" numpy
	touch $@

# privreg's exact samplers (core/dp/samplers.py) beside OpenDP 0.16's, one at a time
bench-samplers: $(STAMP) peer-opendp
	$(BIN)/python benchmarks/bench_samplers.py

# What 30 nightly runs of the demo's jobs cost each table: added up against composed (PLD)
bench-budget: $(STAMP)
	$(BIN)/python benchmarks/bench_budget.py

# horizontal LR under distributed DP: held-out AUC by epsilon beside central DP and none; cost
bench-dp: $(STAMP)
	$(BIN)/python benchmarks/bench_dp.py

bench-sparse-lda: $(STAMP)
	mkdir -p "$(PREFECT_HOME)"
	$(BIN)/python benchmarks/bench_sparse_lda.py

bench: bench-psi bench-paillier bench-vertical bench-walr bench-labeldp bench-horizontal bench-sparse-lda

clean:
	rm -rf var

# PostgreSQL for the organisation's Prefect server (the production option; SQLite stays the
# embedded default): a cluster in PG_DATA listening on 127.0.0.1:PG_PORT only (no Unix socket),
# role and database "prefect", its password generated into PG_DATA.password (0600). Prints the
# setting under which `privreg party serve` starts its server on it. Needs PostgreSQL's initdb,
# pg_ctl, psql and createdb (PG_BIN: found beside pg_ctl) and a normal user (PostgreSQL refuses
# root). Running it again starts the same cluster; stop it with `$(PG_BIN)pg_ctl -D PG_DATA stop`.
PG_DATA ?= $(CURDIR)/var/postgres
PG_PORT ?= 5433
PG_BIN  ?= $(dir $(realpath $(shell command -v pg_ctl)))

.PHONY: prefect-postgres
prefect-postgres:
	@test -x "$(PG_BIN)initdb" || { echo "prefect-postgres: no initdb (set PG_BIN to PostgreSQL's bin folder)"; exit 1; }
	@if [ ! -f "$(PG_DATA)/PG_VERSION" ]; then \
	  mkdir -p "$(dir $(PG_DATA))" && (umask 077; od -An -tx1 -N18 /dev/urandom | tr -d ' \n' > "$(PG_DATA).password") && \
	  "$(PG_BIN)initdb" --pgdata "$(PG_DATA)" --username prefect --pwfile "$(PG_DATA).password" \
	    --auth-local scram-sha-256 --auth-host scram-sha-256 --encoding UTF8 >/dev/null || exit 1; \
	fi
	@"$(PG_BIN)pg_ctl" --pgdata "$(PG_DATA)" status >/dev/null 2>&1 || \
	  "$(PG_BIN)pg_ctl" --pgdata "$(PG_DATA)" --wait --log "$(PG_DATA).log" \
	    -o "-c listen_addresses=127.0.0.1 -c port=$(PG_PORT) -c unix_socket_directories=''" start
	@export PGPASSWORD="$$(cat "$(PG_DATA).password")"; \
	  "$(PG_BIN)psql" -h 127.0.0.1 -p $(PG_PORT) -U prefect -d postgres -tAc \
	    "SELECT 1 FROM pg_database WHERE datname = 'prefect'" | grep -q 1 || \
	  "$(PG_BIN)createdb" -h 127.0.0.1 -p $(PG_PORT) -U prefect prefect
	@echo "PostgreSQL for Prefect on 127.0.0.1:$(PG_PORT) (data $(PG_DATA), log $(PG_DATA).log). Start the service with:"
	@echo "  export PREFECT_SERVER_DATABASE_CONNECTION_URL=\"postgresql+asyncpg://prefect:\$$(cat $(PG_DATA).password)@127.0.0.1:$(PG_PORT)/prefect\""
