#!/usr/bin/env bash
# A PostgreSQL server for tests/test_postgres.py, on a Debian machine without systemd (CI: root,
# Debian apt reachable). Installs Debian's postgresql, creates and starts a cluster by hand, and makes
# a role (allowed to create databases: each test run makes its own and drops it) and a database.
# Idempotent: run it again and it only starts what is stopped.
# Prints the database URL, alone, on stdout (everything else goes to stderr), so CI can do:
#   export DDP_COURSE_POSTGRES_URL=$(bash docker/ci/install-postgres.sh)
#   env PG_USER, PG_PASSWORD, PG_DB   role, its password, database (default ddp, ddp, ddp_course_test)
#       PG_PORT                       port of a cluster this script creates (default 5432)
set -euo pipefail

user=${PG_USER:-ddp}
password=${PG_PASSWORD:-ddp}
db=${PG_DB:-ddp_course_test}
port=${PG_PORT:-5432}
say() { echo "install-postgres: $*" >&2; }

for name in "$user" "$db"; do
    [[ $name =~ ^[a-z_][a-z0-9_]*$ ]] || { say "PG_USER and PG_DB must be plain lower-case SQL names, not '$name'"; exit 2; }
done
[[ $password != *"'"* ]] || { say "PG_PASSWORD must not contain a single quote"; exit 2; }

server_version() { find /usr/lib/postgresql -maxdepth 3 -path '*/bin/postgres' 2>/dev/null | sed 's|/usr/lib/postgresql/||; s|/bin/postgres||' | sort -V | tail -n1; }

if [[ -z $(server_version) ]] || ! command -v pg_ctlcluster >/dev/null; then
    say "installing Debian's postgresql"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends postgresql postgresql-client >&2
fi
version=$(server_version)

# Debian's package normally creates the "main" cluster; an image built without it (or with
# create_main_cluster = false) has none.
if ! pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main" { found = 1 } END { exit !found }'; then
    say "creating cluster $version/main on port $port"
    # UTF-8 whatever this shell's locale: under plain C, initdb makes SQL_ASCII databases, where psycopg
    # returns text as bytes and nbgrader breaks
    pg_createcluster "$version" main --port "$port" --locale C.UTF-8 >&2
fi
port=$(pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main" { print $3 }')

# No systemd: start the cluster by hand. Its socket folder lives on /run, which a fresh container lacks.
install -d -o postgres -g postgres -m 2775 /var/run/postgresql
if ! pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main" && $4 == "online" { found = 1 } END { exit !found }'; then
    say "starting cluster $version/main"
    pg_ctlcluster "$version" main start >&2
fi
for _ in $(seq 60); do
    pg_isready -q -h 127.0.0.1 -p "$port" && break
    sleep 1
done
pg_isready -h 127.0.0.1 -p "$port" >&2 || { say "the server does not answer on 127.0.0.1:$port"; exit 1; }

psql_admin() { runuser -u postgres -- psql -p "$port" -v ON_ERROR_STOP=1 -qAt "$@"; }
if [[ $(psql_admin -c "SELECT 1 FROM pg_roles WHERE rolname = '$user'") != 1 ]]; then
    say "creating role $user"
    psql_admin -c "CREATE ROLE $user LOGIN CREATEDB PASSWORD '$password'" >&2
else
    psql_admin -c "ALTER ROLE $user LOGIN CREATEDB PASSWORD '$password'" >&2
fi
if [[ $(psql_admin -c "SELECT 1 FROM pg_database WHERE datname = '$db'") != 1 ]]; then
    say "creating database $db"
    psql_admin -c "CREATE DATABASE $db OWNER $user ENCODING 'UTF8' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0" >&2
fi

# SQLAlchemy's URL, naming its driver (psycopg 3): plain postgresql:// means psycopg2 before SQLAlchemy 2.1
url="postgresql+psycopg://$user:$password@127.0.0.1:$port/$db"
# the URL must work over TCP with the password (Debian's pg_hba.conf: scram-sha-256 on 127.0.0.1)
PGPASSWORD=$password psql "postgresql://$user@127.0.0.1:$port/$db" -qAt -c 'SELECT 1' >/dev/null
say "PostgreSQL $version is up; URL below (export it as DDP_COURSE_POSTGRES_URL)"
echo "$url"
