//! The README stays true: its configuration table is exactly the one the code defines.
use streaming_hub::config::Config;

#[test]
fn readme_configuration_table_matches_the_code() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let table = Config::markdown_table();
    assert!(
        readme.contains(table.trim()),
        "README.md's configuration table is stale; paste the output of `streaming-hub config`:\n{table}"
    );
}
