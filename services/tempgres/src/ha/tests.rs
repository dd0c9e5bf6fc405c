use super::*;

#[test]
fn reads_the_monitors_view_of_the_nodes() {
    let json = r#"[
{"health": 1, "node_id": 1, "nodehost": "127.0.0.1", "nodename": "node1", "nodeport": 55001,
 "current_group_state": "primary", "assigned_group_state": "primary"},
{"health": 1, "node_id": 2, "nodehost": "127.0.0.1", "nodename": "node2", "nodeport": 55002,
 "current_group_state": "secondary", "assigned_group_state": "secondary"}
]"#;
    let state = parse_state(json);
    assert_eq!(state.len(), 2);
    assert_eq!(state[0].name, "node1");
    assert_eq!(state[0].port, 55001);
    assert_eq!(state[1].reported, "secondary");
    assert!(parse_state("ERROR: could not connect to the monitor").is_empty());
}

#[test]
fn a_printed_command_is_one_shell_word_per_argument() {
    assert_eq!(
        shell_quoted("/tmp/retrychain-ha-x/monitor"),
        "/tmp/retrychain-ha-x/monitor"
    );
    assert_eq!(shell_quoted("a b"), "'a b'");
    assert_eq!(shell_quoted("it's"), "'it'\\''s'");
    assert_eq!(shell_quoted(""), "''");
}
