// `sqlx::migrate!` embeds the crate's migrations: rebuild when they change.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
