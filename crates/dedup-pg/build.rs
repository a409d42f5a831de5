// `sqlx::migrate!` embeds the top-level migrations: rebuild when they change.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
