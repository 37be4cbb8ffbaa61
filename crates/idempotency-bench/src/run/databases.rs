//! The run's databases: its own, shared by the core scenarios, and one for each kind of state
//! the selected scale scenarios need.

use crate::{
    BoxError,
    app::PARTITION_WIDTH,
    cli::BenchArgs,
    db::BenchDb,
    report, scale,
    scenario::{Database, Http, Runner, Scenario},
};

/// The run's databases: its own, shared by the core scenarios, and one more for each kind of
/// state the selected scale scenarios need (created once per run, dropped at the end).
pub(super) struct Databases {
    dbs: Vec<(Database, BenchDb)>,
    /// How many replayable records each database was filled with.
    filled: Vec<(Database, u64)>,
    /// What preparing them took, for the report.
    pub(super) notes: Vec<String>,
    /// Whether `pg_walinspect` could be enabled in them (scale scenarios).
    pub(super) inspects_wal: bool,
}

impl Databases {
    pub(super) async fn create(
        url: Option<&str>,
        selected: &[&Scenario],
        settings: &[(String, String)],
    ) -> Result<Self, BoxError> {
        let mut wanted = vec![Database::Run];
        for scenario in selected {
            if let Runner::Http(http) = &scenario.runner
                && !wanted.contains(&http.database)
            {
                wanted.push(http.database);
            }
        }
        let scale = selected.iter().any(|s| s.scale);
        let mut dbs = Vec::with_capacity(wanted.len());
        let mut inspects_wal = scale;
        for kind in wanted {
            // On an error, those already created are dropped with `dbs`.
            let db = BenchDb::create(url).await?;
            eprintln!("created database {} ({})", db.name(), describe(kind));
            for (name, value) in settings {
                db.set(name, value).await?;
            }
            if scale {
                inspects_wal &= scale::enable_wal_inspection(&db).await;
            }
            dbs.push((kind, db));
        }
        if scale && !inspects_wal {
            eprintln!("note: pg_walinspect is not available; WAL is the whole server's only");
        }
        Ok(Self {
            dbs,
            filled: Vec::new(),
            notes: Vec::new(),
            inspects_wal,
        })
    }

    pub(super) fn get(&self, kind: Database) -> &BenchDb {
        self.dbs
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, db)| db)
            .expect("every database a selected scenario uses is created")
    }

    pub(super) fn run(&self) -> &BenchDb {
        self.get(Database::Run)
    }

    /// Replayable records filled into `kind`.
    pub(super) fn filled(&self, kind: Database) -> u64 {
        self.filled
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |(_, rows)| *rows)
    }

    /// The once-per-run fills: the empty store's handful of records, the full store's many.
    pub(super) async fn prepare(&mut self, args: &BenchArgs) -> Result<(), BoxError> {
        for i in 0..self.dbs.len() {
            let (kind, db) = (self.dbs[i].0, &self.dbs[i].1);
            let rows = match kind {
                Database::Empty => scale::EMPTY_STORE_ROWS,
                Database::Full => args.full_store_rows,
                _ => continue,
            };
            eprintln!(
                "filling the {} store ({}) with {} completed records by SQL...",
                if kind == Database::Full {
                    "full"
                } else {
                    "empty"
                },
                db.name(),
                report::format_rate(rows as f64),
            );
            let label = (kind == Database::Full).then_some("full store");
            let fill = scale::fill_completed(db, rows, label).await?;
            let what = if kind == Database::Full {
                "full store"
            } else {
                "empty store"
            };
            let note = fill.describe(what);
            eprintln!("{note}");
            self.notes.push(note);
            self.filled.push((kind, rows));
            if kind == Database::Empty {
                eprintln!("measuring bytes per record by body size...");
                self.notes.push(scale::record_sizes(db).await?);
            }
        }
        Ok(())
    }

    /// Puts `http`'s database in the state its measurement starts from; says what it did.
    pub(super) async fn before(
        &self,
        http: &Http,
        args: &BenchArgs,
    ) -> Result<Option<String>, BoxError> {
        let db = self.get(http.database);
        match http.database {
            Database::Expired => Ok(Some(scale::restore_expired(db, args.expired_rows).await?)),
            Database::ExpiredPartitions => Ok(Some(
                scale::restore_expired_partitions(db, args.expired_rows, PARTITION_WIDTH).await?,
            )),
            Database::Run | Database::Empty | Database::Full => Ok(None),
        }
    }

    pub(super) async fn drop_all(self) {
        for (_, db) in self.dbs {
            let name = db.name().to_owned();
            match db.drop_database().await {
                Ok(()) => eprintln!("dropped database {name}"),
                Err(error) => eprintln!("warning: could not drop database {name}: {error}"),
            }
        }
    }
}

fn describe(kind: Database) -> &'static str {
    match kind {
        Database::Run => "the core scenarios",
        Database::Empty => "the empty store",
        Database::Full => "the full store",
        Database::Expired => "expired records",
        Database::ExpiredPartitions => "expired partitions",
    }
}
