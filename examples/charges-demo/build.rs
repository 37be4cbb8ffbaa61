// The demo's migrations are embedded with `sqlx::migrate!`; rebuild when they change.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
